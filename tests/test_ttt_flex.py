"""train.attention flex: FlexAttention computes the same TTT attention as the eager scores.

What a user relies on: switching the kernel (auto picks flex on a GPU) changes speed and memory,
never what the draft learns. FlexAttention computes gradients on CUDA only, so on a CPU the
outputs are compared (forward); the mask, which is all the two paths could disagree on, is in it.
"""
import pytest
import torch

from draftlab.errors import UserError
from draftlab.features.dataset import pack
from draftlab.train.draft import TTTCache
from draftlab.train.ttt_flex import extend_block_mask, ttt_block_mask
from draftlab.train.loop import attention_kernel, init_draft
from draftlab.train.objective import TTT, step_token_counts, target_labels
from tiny_features import training_kit

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")  # uncompiled on a CPU: slow, but exact


def packed_rows(T: int) -> torch.Tensor:
    """Two rows of packed sequences: three in the first, one then padding (-1) in the second."""
    a, b = T // 4, T // 2
    return torch.tensor([[0] * a + [1] * b + [2] * (T - a - b), [0] * (T - T // 5) + [-1] * (T // 5)])


@pytest.mark.parametrize("T", [128, 384])
@pytest.mark.parametrize("packed", [False, True])
def test_a_later_steps_mask_grown_from_step_zeros_is_the_mask_built_whole(T, packed):
    seq_ids = packed_rows(T) if packed else None
    first = ttt_block_mask(seq_ids, 2, T, 1, "cpu", False)
    for steps_seen in (2, 3, 5):
        whole, grown = ttt_block_mask(seq_ids, 2, T, steps_seen, "cpu", False), extend_block_mask(first, T, steps_seen)
        assert grown.shape == whole.shape
        assert torch.equal(grown.to_dense(), whole.to_dense())  # the same blocks visited...
        for attr in ("full_kv_num_blocks", "kv_num_blocks"):  # ...the same ones taken whole, the same masked
            assert torch.equal(getattr(grown, attr), getattr(whole, attr)), attr
    off = packed_rows(T + 1) if packed else None  # off the tiles: each step's mask is built whole
    assert extend_block_mask(ttt_block_mask(off, 2, T + 1, 1, "cpu", False), T + 1, 2) is None


def attend_steps(kernel, q, ks, vs, seq_ids):
    """Each step's attention output over the keys of the steps so far, as TTT drives the cache."""
    cache = TTTCache(seq_ids, kernel)
    return [cache.attend(qi, k, v) for qi, k, v in zip(q, ks, vs)]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("T", [37, 256])  # a width that is no multiple of the 128-wide tiles (each step's mask built
def test_flex_attention_equals_eager_over_every_step(packed, T):  # whole), and one that is (grown from step 0's)
    torch.manual_seed(0)
    B, h, n_kv, hd, steps = 2, 4, 2, 8, 4  # grouped heads
    q = [torch.randn(B, h, T, hd) for _ in range(steps)]
    ks = [torch.randn(B, n_kv, T, hd) for _ in range(steps)]
    vs = [torch.randn(B, n_kv, T, hd) for _ in range(steps)]
    # two rows of packed sequences (the second ends in padding, -1), or one sequence per row
    seq_ids = packed_rows(T) if packed else None
    eager, flex = attend_steps("eager", q, ks, vs, seq_ids), attend_steps("flex", q, ks, vs, seq_ids)
    for i, (a, b) in enumerate(zip(eager, flex)):
        assert torch.allclose(a, b, atol=1e-5), f"step {i}: max difference {(a - b).abs().max():.2e}"


def test_a_packed_training_step_scores_the_same_with_either_kernel(tmp_path):
    kit = training_kit(tmp_path)
    draft = init_draft(kit["cfg"], kit["embed"], kit["head"], kit["d2t"], kit["t2d"], 0)
    ds = kit["train"]
    lengths = [ds.length(i) for i in range(4)]
    batch = pack(ds.batch(list(range(4)), "cpu"), [lengths[:2], lengths[2:3], lengths[3:]])  # 2, 1 and 1 sequences a row
    labels = target_labels(batch["final_hidden"], kit["head"], draft.d2t)
    counts = step_token_counts(batch, 3, 1)
    with torch.no_grad():
        eager = TTT(draft, 3, 0.8, "eager")(batch, labels, counts)
        flex = TTT(draft, 3, 0.8, "flex")(batch, labels, counts)
    assert torch.allclose(eager[0], flex[0], atol=1e-5)
    assert torch.allclose(eager[1], flex[1], atol=1e-4)  # ce sums, scored tokens, hits, accepted, reached per step


def test_train_attention_setting():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert attention_kernel("auto", cpu) == "eager" and attention_kernel("auto", gpu) == "flex"
    assert attention_kernel("eager", gpu) == "eager"
    with pytest.raises(UserError, match="train.attention flex needs a CUDA device"):
        attention_kernel("flex", cpu)


def compiled_layer_graphs(tmp_path, steps: int, trace_flex: bool) -> int:
    """Graphs dynamo makes of the draft's compiled layer over one flex TTT forward of `steps` steps."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    kit = training_kit(tmp_path)
    draft = init_draft(kit["cfg"], kit["embed"], kit["head"], kit["d2t"], kit["t2d"], 0)
    counter = CompileCounter()  # counts graphs without compiling kernels: the guards are what is tested
    draft.midlayer.compile(backend=counter, dynamic=True)
    ds = kit["train"]
    batch = pack(ds.batch([0, 1], "cpu"), [[ds.length(0), ds.length(1)]])
    labels = target_labels(batch["final_hidden"], kit["head"], draft.d2t)
    saved, TTTCache.trace_flex = TTTCache.trace_flex, trace_flex
    try:
        with torch.no_grad():
            TTT(draft, steps, 0.8, "flex")(batch, labels, step_token_counts(batch, steps, 1))
    finally:
        TTTCache.trace_flex = saved
        torch._dynamo.reset()
    return counter.frame_count


def test_the_compiled_draft_layer_compiles_once_whatever_the_ttt_depth(tmp_path):
    """train.compile's warm-up: the layer's graphs do not grow with train.ttt_steps (each graph is
    compiled forward and backward on a GPU, tens of seconds apiece at SmolLM2's shape)."""
    shallow, deep = compiled_layer_graphs(tmp_path / "a", 2, False), compiled_layer_graphs(tmp_path / "b", 5, False)
    assert shallow == deep
    # the flex attention traced into the layer: one more graph per step (what the default avoids)
    assert compiled_layer_graphs(tmp_path / "c", 5, True) > deep
