"""Lab 20: wrong-but-plausible First Block Caches fail, the commonest by name; the reference is diffusers' hooks."""
import copy
from pathlib import Path

import torch

from diffusion_katas.core.course import load_module
from expect import Fails

LAB = "20_first_block_cache"
REPO = Path(__file__).resolve().parents[2]


def step_body(decide="cache is None or residual_change(r, cache['head_residual']) > threshold",
              skip="hid1 + tail_hid, enc1 + tail_enc, {**cache, 'should_compute': False}",
              tail="(hid - hid1, enc - enc1)", head="r") -> str:
    """A body for first_block_cache_step with one line swapped for a wrong one."""
    return f"""
    enc1, hid1 = blocks[0](hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                           temb=temb, image_rotary_emb=image_rotary_emb)
    r = hid1 - hidden_states
    if not ({decide}):
        tail_hid, tail_enc = cache["tail_residuals"]
        return {skip}
    hid, enc = run_blocks(blocks[1:], hid1, enc1, temb, image_rotary_emb)
    return hid, enc, {{"head_residual": {head}, "head_output": (hid1, enc1), "tail_residuals": {tail},
                      "should_compute": True}}
    """


def calls_body(key='call["context"]', keep="caches[key] = cache") -> str:
    """A body for cached_transformer_calls with its cache bookkeeping swapped."""
    return f"""
    caches, out = {{}}, []
    for call in calls:
        key = {key}
        hid, enc, cache = first_block_cache_step(blocks, call["hidden_states"], call["encoder_hidden_states"],
                                                 call["temb"], call["image_rotary_emb"], caches.get(key), threshold)
        {keep}
        out.append((hid, enc, cache["should_compute"]))
    return out
    """


MUTANTS = [
    ("residual_change",  # a blind learner's: a mean of per-sample ratios
     """
     r, c = residual.double().flatten(1), cached_residual.double().flatten(1)
     return ((r - c).abs().mean(dim=1) / c.abs().mean(dim=1)).mean().item()
     """, "δ per sample, then averaged over the batch"),
    ("residual_change", "return float((residual - cached_residual).abs().mean() / residual.abs().mean())",
     "δ relative to the current residual"),
    ("residual_change", "return float((residual - cached_residual).mean().abs() / cached_residual.abs().mean())",
     "the signed mean of the difference"),
    ("residual_change", "return float((residual - cached_residual).norm() / cached_residual.norm())",
     "an L2 change"),
    ("residual_change",  # the ratio of the means, not the mean of the differences
     "return float(abs(residual.abs().mean() - cached_residual.abs().mean()) / cached_residual.abs().mean())",
     Fails("wrong", "")),
    ("first_block_cache_step", step_body(skip="hid1 + tail_hid, enc1 + tail_enc, "
                                              "{**cache, 'head_residual': r, 'should_compute': False}"),
     "the cached residual refreshed on a skipped step"),
    ("first_block_cache_step", step_body(tail="(hid - hidden_states, enc - encoder_hidden_states)"),
     "the tail residual taken from the blocks' input"),
    ("first_block_cache_step", step_body(skip="hid1 + tail_hid, enc1, {**cache, 'should_compute': False}"),
     "only the image stream restored on a skipped step"),
    ("first_block_cache_step",  # the test turned around: skips where diffusers runs every block, and the reverse
     step_body(decide="cache is None or residual_change(r, cache['head_residual']) < threshold"),
     Fails("wrong", "")),
    ("first_block_cache_step",  # ≥ for >: an unchanged call at threshold 0 runs every block where diffusers skips
     step_body(decide="cache is None or residual_change(r, cache['head_residual']) >= threshold"),
     "every block run when δ equals the threshold"),
    ("first_block_cache_step",  # the head output cached as the residual
     step_body(head="hid1"), Fails("wrong", "")),
    ("first_block_cache_step",  # the cache handed back as it came in after a skip: should_compute left True
     step_body(skip="hid1 + tail_hid, enc1 + tail_enc, cache"), Fails("wrong", "")),
    ("residual_change",  # diffusers' own hook asked for the answer: the answer key is locked
     """
     from diffusers.hooks.first_block_cache import FBCHeadBlockHook, FBCSharedBlockState
     from diffusers.hooks.hooks import CacheContext, StateManager
     manager = StateManager(FBCSharedBlockState)
     manager.set_context(CacheContext("cond"))
     manager.get_state().head_block_residual = cached_residual
     hook = FBCHeadBlockHook(manager, 0.1)
     return 0.2 if hook._should_compute_remaining_blocks(residual) else 0.0
     """, Fails("answer key", "")),
    ("cached_transformer_calls",  # the blocks hooked by diffusers' own cache
     """
     from diffusers.hooks import FirstBlockCacheConfig
     from diffusers.hooks.first_block_cache import apply_first_block_cache
     holder = torch.nn.Module()
     holder.transformer_blocks = blocks
     apply_first_block_cache(holder, FirstBlockCacheConfig(threshold=threshold))
     return []
     """, Fails("answer key", "")),
    ("cached_transformer_calls", calls_body(key='"shared"'), "one cache shared by the cond and uncond calls"),
    ("cached_transformer_calls", calls_body(keep="pass"), "the returned cache dropped"),
    ("cached_transformer_calls",  # a blind learner's: the caches kept between calls (a mutable default there)
     calls_body().replace("caches, out = {}, []", "caches, out = globals().setdefault('_caches', {}), []"),
     "state kept between calls"),
    ("cached_transformer_calls",  # a blind learner's: cond on even calls, uncond on odd ones
     calls_body(key="len(out) % 2"), "the caches picked by the call's position (even/odd)"),
    ("cached_transformer_calls",  # a blind learner's: separate caches, but uncond forced to the cond decision
     """
     caches, out, cond_ran = {}, [], True
     for call in calls:
         ctx = call["context"]
         here = threshold if ctx == "cond" or ctx not in caches else (-1.0 if cond_ran else float("inf"))
         hid, enc, caches[ctx] = first_block_cache_step(blocks, call["hidden_states"], call["encoder_hidden_states"],
                                                        call["temb"], call["image_rotary_emb"], caches.get(ctx), here)
         if ctx == "cond":
             cond_ran = caches[ctx]["should_compute"]
         out.append((hid, enc, caches[ctx]["should_compute"]))
     return out
     """, "the uncond call made to follow the cond call's decision"),
    ("cached_transformer_calls",  # a blind learner's: the flag read from the cache passed in (the previous decision)
     """
     caches, out = {}, []
     for call in calls:
         old = caches.get(call["context"])
         hid, enc, caches[call["context"]] = first_block_cache_step(
             blocks, call["hidden_states"], call["encoder_hidden_states"], call["temb"], call["image_rotary_emb"],
             old, threshold)
         out.append((hid, enc, True if old is None else old["should_compute"]))
     return out
     """, "the computed flag read from the cache before the call"),
]

ALTERNATIVES = [
    ("residual_change",  # in float64, with sums instead of means (the element counts cancel)
     """
     r, c = residual.double(), cached_residual.double()
     return ((r - c).abs().sum() / c.abs().sum()).item()
     """, "float64, sums for means"),
    ("first_block_cache_step", step_body(
        skip="tail_hid + hid1, tail_enc + enc1, dict(cache, should_compute=False)",
        tail="(hid.double().sub(hid1.double()).float(), enc.double().sub(enc1.double()).float())"),
     "the tail residual subtracted in float64, the addition in the other order"),
]


def _grader():
    return load_module(REPO / "graders" / f"{LAB}.py", f"_test_grader_{LAB}")


def test_the_recorded_outputs_are_the_hooked_models_own_block_outputs():
    """The reference is what the hooked model computed: replaying a run without the cache gives other values
    exactly where diffusers skipped, and the same values where it ran every block."""
    grader = _grader()
    torch.manual_seed(0)
    case = dict(grader.RUN_CASES[0])
    blocks, calls, threshold = grader.run(case, torch.Generator().manual_seed(0))
    skipped = [c for c in calls if not c["cache_after"]["should_compute"]]
    assert skipped and len(skipped) < len(calls)
    for c in calls:
        with torch.no_grad():
            hid, enc = c["hidden_states"], c["encoder_hidden_states"]
            for block in blocks:
                enc, hid = block.block(hidden_states=hid, encoder_hidden_states=enc, temb=c["temb"],
                                       image_rotary_emb=c["image_rotary_emb"])
        same = torch.allclose(hid, c["output"][0], atol=1e-5, rtol=1e-5)
        assert same == c["cache_after"]["should_compute"], c["context"]


def test_each_context_has_its_own_cache_in_diffusers_too():
    grader = _grader()
    torch.manual_seed(1)
    blocks, calls, _ = grader.run(dict(grader.RUN_CASES[0]), torch.Generator().manual_seed(1))
    first_uncond = next(c for c in calls if c["context"] == "uncond")
    assert calls[0]["cache_before"] is None and first_uncond["cache_before"] is None


def test_every_threshold_is_kept_away_from_every_delta():
    grader = _grader()
    for seed in range(3):
        torch.manual_seed(seed)
        for case in grader.STEP_CASES + grader.RUN_CASES:
            blocks, calls, threshold = grader.run(dict(case), torch.Generator().manual_seed(seed))
            deltas = [d for d in grader._deltas(blocks, calls) if d is not None]
            assert all(abs(d - threshold) > 0.02 * threshold for d in deltas)
            flags = [c["cache_after"]["should_compute"] for c in calls]
            assert True in flags and False in flags


def test_the_hooks_delta_is_the_relative_l1_change():
    grader = _grader()
    g = torch.Generator().manual_seed(0)
    c, r = torch.randn(2, 8, 16, generator=g, dtype=torch.float64), torch.randn(2, 8, 16, generator=g, dtype=torch.float64)
    assert abs(grader.hook_delta(r, c) - float((r - c).abs().mean() / c.abs().mean())) < 1e-12


def test_counted_blocks_slices_log_into_the_same_list():
    grader = _grader()
    blocks = grader.CountedBlocks([torch.nn.Identity(), torch.nn.Identity(), torch.nn.Identity()])
    blocks[0](1)
    for block in blocks[1:]:
        block(2)
    copied = copy.deepcopy(blocks)
    copied[2](3)
    assert blocks.calls == [0, 1, 2] and copied.calls == [0, 1, 2, 2]
    # remote: the learner's runner gets stand-ins for the blocks, and the log stays the grader's own
    assert grader._Counted.kata_remote


def test_the_cases_vary_what_the_lesson_teaches():
    # with and without true CFG (one or two contexts), N from 3 to 4 blocks split both ways, B > 1
    grader = _grader()
    cases = grader.STEP_CASES + grader.RUN_CASES
    assert {bool(c["cfg"]) for c in grader.STEP_CASES} == {True, False}
    assert {bool(c["cfg"]) for c in grader.RUN_CASES} == {True, False}
    assert {c["layers"] for c in cases} >= {(1, 3), (3, 1), (2, 2)}
    assert any(c["batch"] > 1 for c in cases)


def cache_written_into() -> str:
    """The solution's first_block_cache_step with the skipped call writing into the caller's cache dict: the right
    values, the old cache gone."""
    import textwrap

    lines = (REPO / "solutions" / f"{LAB}.py").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("def first_block_cache_step("))
    begin = next(i for i in range(start, len(lines)) if "# BEGIN SOLUTION" in lines[i])
    end = next(i for i in range(begin, len(lines)) if "# END SOLUTION" in lines[i])
    block = textwrap.dedent("\n".join(lines[begin + 1:end]))
    skipped = 'return hid_1 + tail_hid, enc_1 + tail_enc, {**cache, "should_compute": False}'
    line = next((line for line in block.splitlines() if line.strip() == skipped), None)
    assert line is not None, "the solution's skipped call moved: update this mutant"
    indent = line[:len(line) - len(line.lstrip())]
    return block.replace(line, f'{indent}cache["should_compute"] = False\n'
                               f'{indent}return hid_1 + tail_hid, enc_1 + tail_enc, cache')


def test_a_cache_dict_written_into_fails_as_a_changed_input_though_its_values_are_right(grade_mutant):
    # In-place checks cover every mutable input, not only tensors: the dict the caller still holds
    graded = grade_mutant(LAB, "first_block_cache_step", cache_written_into(), "-m", "not budget")
    assert graded.status == "failed", graded
    assert "mutated input" in graded.reasons, graded
    assert "changed its input(s) cache['should_compute'] in place" in graded.text, graded.text
