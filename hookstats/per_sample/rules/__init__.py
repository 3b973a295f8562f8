"""The per-sample rules shipped with hookstats, one file per layer type (importing registers them)."""
from . import (conv, embedding, embedding_bag, group_norm, hf_conv1d, hf_rms_norm, layer_norm, linear,  # noqa: F401
               mixtral_router, refused, rms_norm, timm_conv2d_same, timm_layer_norm2d, timm_std_conv)
