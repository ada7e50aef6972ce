import subprocess
import sys
import textwrap

from _util import requires_native

from sgl_ecospec import has_native


@requires_native
def test_extension_registers_ops():
    import torch

    assert has_native()
    for name in ("topk_to_bitmap", "bitmap_popcount", "select_verify_set"):
        assert hasattr(torch.ops.sgl_ecospec, name)


@requires_native
def test_select_op_keeps_its_old_arguments():
    # Callers of the op written before expert_rank / step_cost still work: the new
    # arguments have schema defaults (no placement, unit account).
    import torch

    from sgl_ecospec.synthetic import random_draft_tree

    tree = random_draft_tree(3, 12, 2, 64, 4, seed=2)
    old = (tree.scores, tree.parents, tree.node_experts, 5, tree.root_experts, "ecospec")
    out = torch.ops.sgl_ecospec.select_verify_set(*old, 0.1, False, None)
    full = torch.ops.sgl_ecospec.select_verify_set(*old, 0.1, False, None, None, 1, 0.0, 1.0, 1.0)
    assert torch.equal(out, full)
    assert (out >= 0).sum().item() == 15


def test_import_without_extension_falls_back_with_a_clear_message():
    # A fresh interpreter in which sgl_ecospec._C cannot be imported.
    script = textwrap.dedent(
        """
        import sys, warnings
        import importlib.abc

        class HideExtension(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "sgl_ecospec._C":
                    raise ImportError("simulated: extension not built")

        sys.meta_path.insert(0, HideExtension())
        import torch
        import sgl_ecospec
        assert not sgl_ecospec.has_native()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = sgl_ecospec.topk_to_bitmap(torch.tensor([[1, 2]]), 8)
        assert out.tolist() == [[6]], out
        message = str(caught[0].message)
        assert "simulated: extension not built" in message and "setup_env.sh" in message
        try:
            sgl_ecospec.topk_to_bitmap(torch.tensor([[1]]), 8, impl="native")
        except RuntimeError as exc:
            assert "setup_env.sh" in str(exc)
        else:
            raise AssertionError("impl='native' must fail without the extension")
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
