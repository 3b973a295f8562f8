"""Without the compiled extension, hookstats warns and falls back to the pure-PyTorch reference."""
import subprocess
import sys
import textwrap


def test_import_without_extension_warns_and_falls_back():
    code = textwrap.dedent(
        """
        import sys, warnings
        sys.modules["hookstats._C"] = None  # makes `from . import _C` raise ImportError
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import hookstats
        assert not hookstats.HAVE_EXTENSION
        assert any(issubclass(w.category, RuntimeWarning) and "reference" in str(w.message) for w in caught), \\
            [str(w.message) for w in caught]
        import torch
        x = torch.tensor([1.0, -2.0, 0.0, float("nan"), 4.0])
        s = hookstats.stats(x)
        assert int(s.numel) == 5 and int(s.nan_count) == 1 and int(s.zero_count) == 1
        assert torch.isnan(s.l2)
        y = torch.tensor([3.0, 4.0])
        assert float(hookstats.stats(y).l2) == 5.0
        counts = hookstats.histogram(x, 4, range=(-2.0, 2.0))
        assert counts.tolist() == [1, 0, 1, 1, 0, 1, 1], counts.tolist()  # -2 | 0 | 1 ; 4 over ; NaN
        buf = hookstats.stats_buffer(2)
        hb = hookstats.histogram_buffer(2, (4, (-2.0, 2.0)))
        hookstats.stats_into(x, buf, 1, hist=hb, histogram=(4, (-2.0, 2.0)))
        hookstats.stats_into(x, buf, 1, hist=hb, histogram=(4, (-2.0, 2.0)))  # written, not added
        assert int(buf[1, 0]) == 5 and hb[1].tolist() == [1, 0, 1, 1, 0, 1, 1], hb[1].tolist()
        hookstats.stats_into(x, buf, 1, hist=hb, histogram=(4, (-2.0, 2.0)), accumulate=True)
        assert hb[1].tolist() == [2, 0, 2, 2, 0, 2, 2], hb[1].tolist()
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_clipping_without_extension_uses_the_reference():
    code = textwrap.dedent(
        """
        import sys, warnings
        sys.modules["hookstats._C"] = None
        warnings.simplefilter("ignore")
        import hookstats, torch
        assert not hookstats.HAVE_EXTENSION
        x = torch.tensor([3.0, 4.0])
        n = hookstats.clip_norm_(x, 1.0)
        assert float(n) == 5.0 and abs(float(x.norm()) - 1.0) < 1e-5, (n, x)
        y = torch.tensor([-2.0, 0.5, 3.0, float("nan")])
        assert int(hookstats.clip_value_(y, 1.0)) == 2 and y[:3].tolist() == [-1.0, 0.5, 1.0] and y[3].isnan()
        ps = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
        ps[0].grad = torch.tensor([3.0, 0.0]); ps[1].grad = torch.tensor([0.0, 4.0])
        total = hookstats.clip_grad_norm_(ps, 1.0)
        assert float(total) == 5.0 and abs(float(ps[1].grad[1]) - 0.8) < 1e-5
        assert abs(float(hookstats.get_total_norm([torch.ones(4)], 1.0)) - 4.0) < 1e-6
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
