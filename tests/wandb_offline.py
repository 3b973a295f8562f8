"""Reading a wandb offline run back, for the tests: the run's transaction log (run-<id>.wandb) in the LevelDB log
format wandb writes (a 7-byte header ':W&B' 0xBEE1 version 0, then 32 KiB blocks of records, each a 7-byte header
crc32c / length / type FULL-FIRST-MIDDLE-LAST and a chunk), every record a `wandb.proto.wandb_internal_pb2.Record`.
wandb 0.31 ships no Python reader of its own (its sdk.internal.datastore went with the Go core), so this follows the
format its writer documents; a file that does not match fails loudly, not silently."""
from __future__ import annotations

import glob
import json
import os
import struct

_BLOCK = 32768
_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: str):
    """The protobuf Records of a .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    if data[:7] != _HEADER:
        raise ValueError(f"{path}: not a wandb transaction log (header {data[:7]!r})")
    pos, parts = 7, []
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, typ = struct.unpack("<IHB", data[pos:pos + 7])
        if typ == 0 and length == 0:  # zero padding
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        if len(chunk) < length:
            raise ValueError(f"{path}: record cut short at byte {pos}")
        pos += 7 + length
        if typ == _FULL:
            parts = [chunk]
        elif typ == _FIRST:
            parts = [chunk]
            continue
        elif typ == _MIDDLE:
            parts.append(chunk)
            continue
        elif typ == _LAST:
            parts.append(chunk)
        else:
            raise ValueError(f"{path}: unknown record type {typ} at byte {pos}")
        rec = pb.Record()
        rec.ParseFromString(b"".join(parts))
        yield rec


def history(wandb_dir: str) -> list:
    """[{key: value}] per logged step (values JSON-decoded; `_step` included; rows of one step merged) of the one
    offline run under wandb_dir/wandb/."""
    runs = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))
    if len(runs) != 1:
        raise ValueError(f"expected one offline run under {wandb_dir}, found {runs}")
    out = []
    for rec in records(runs[0]):
        if rec.WhichOneof("record_type") == "history":
            row = {}
            for item in rec.history.item:
                key = item.key if item.key else "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            if out and out[-1].get("_step") == row.get("_step"):  # one step written as more than one row
                out[-1].update(row)
            else:
                out.append(row)
    return out
