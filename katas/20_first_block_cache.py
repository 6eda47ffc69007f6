"""Lab 20 · First Block Cache: skip the transformer when its first block barely changed

Concept:
    Late in a sampling run, consecutive steps feed a diffusion transformer almost the same input, and
    its blocks change the hidden states almost the same way from one step to the next. First Block
    Cache (ParaAttention, after TeaCache, Liu et al. 2024) uses the cheapest probe there is: run the
    first block only and compare the change it made (its residual, output − input) with the residual
    it made at the last step that ran every block. If the relative L1 change
        δ = mean|r − r_cached| / mean|r_cached|
    is at most the threshold, the other blocks are skipped and their effect is reused: the last full
    run's tail residual (the last block's output − the first block's output) is added to the first
    block's output. Otherwise every block runs and the cache is refreshed. A skipped step costs one
    block of N, and the image drifts a little from the uncached one: the threshold trades the two.

Mental model:
    - Notation: blocks b_1 … b_N (Flux: its double-stream blocks, then its single-stream ones); each
      takes and returns both token streams, x (image, `hidden_states`) and c (text,
      `encoder_hidden_states`), as (c, x) = b(hidden_states=x, encoder_hidden_states=c, temb=…,
      image_rotary_emb=…).
    - What is cached, per context (diffusers' FBCSharedBlockState):
        head_residual   r_cached = b_1(x)_x − x, at the last step that ran every block
        head_output     (x₁, c₁): b_1's output at that step
        tail_residuals  (x_N − x₁, c_N − c₁): what b_2 … b_N added to each stream at that step
        should_compute  whether the current step ran every block
    - A step: run b_1; r = x₁ − x; compute every block if there is no cached residual yet or δ > threshold
      (strictly: δ = 0 at threshold 0 still skips), then cache (r, (x₁, c₁), (x_N − x₁, c_N − c₁));
      else return (x₁ + tail_x, c₁ + tail_c) and leave the cache as it was.
    - Skipping never refreshes the cache: δ keeps being measured against the last computed step, so
      small changes add up until they cross the threshold and force a full run.
    - Classifier-free guidance calls the transformer twice a step with different prompts: the pipeline
      wraps each call in transformer.cache_context("cond") or ("uncond"), and each name has its own
      cache. At the end of a generation the pipeline resets every cache (maybe_free_model_hooks).
    - Only the blocks are skipped: the embedders before them and norm_out / proj_out after them run at
      every step.

Traps:
    - Refreshing the cached residual on a skipped step: δ then compares neighbouring steps only, a slow
      drift never crosses the threshold, and the tail residual grows stale without limit.
    - The tail residual taken from the blocks' input (x_N − x) instead of from b_1's output (x_N − x₁):
      adding it to x₁ counts b_1's change twice.
    - δ relative to the current residual (mean|r − r_cached| / mean|r|), or without the abs (the signed
      differences cancel), or as an L2 norm: another number, other skips.
    - Caching the image stream only: the text stream of a skipped step must get its tail residual too.
    - One cache for the cond and uncond calls: the uncond call is then compared with the cond call's
      residual (a different prompt) and would be given the cond call's tail.
    - Deciding to skip but running the other blocks anyway (and throwing their output away): right
      values, no saving. The budget counts block calls.

Precision:
    The course's one policy (lab 01 states it): compute as wide as you like. δ is judged against
    diffusers' own float32 value and exact float64 math (its hook run on float64 residuals); the outputs
    are the same blocks on the same inputs plus one addition, judged against the hooked model's own.
    The grader keeps every threshold at least 2% away from every δ it meets, so a decision never turns on
    rounding.

Say it out loud:
    "Run the first block, compare its residual with the one cached at the last full step: mean |r − r_c|
    over mean |r_c|. Above the threshold run everything and cache the first block's residual, its output
    and what the other blocks added to each stream; at or below it, add the cached tail to the first
    block's output and skip the rest, without touching the cache. Cond and uncond keep separate caches."

Graded against: diffusers.hooks.apply_first_block_cache (FBCHeadBlockHook, FBCBlockHook) through
FluxTransformer2DModel.enable_cache(FirstBlockCacheConfig(threshold)) on a tiny random Flux transformer,
run the way FluxPipeline runs it (cache_context "cond" / "uncond", a FlowMatchEulerDiscreteScheduler loop),
the inputs, outputs and cache state of its blocks recorded at every call.
Run: python -m pytest katas/20_first_block_cache.py
"""
import torch


# ---- Worked example --------------------------------------------------------------------------------
def run_blocks(blocks, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
               image_rotary_emb) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block in order, as FluxTransformer2DModel.forward runs them between its embedders and norm_out.

    Each block takes both streams and returns (encoder_hidden_states, hidden_states): text first.
    Returns: (hidden_states, encoder_hidden_states) after the last block (image first, as this lab does).
    """
    for block in blocks:
        encoder_hidden_states, hidden_states = block(hidden_states=hidden_states,
                                                     encoder_hidden_states=encoder_hidden_states,
                                                     temb=temb, image_rotary_emb=image_rotary_emb)
    return hidden_states, encoder_hidden_states


# ---- Your turn -------------------------------------------------------------------------------------
def residual_change(residual: torch.Tensor, cached_residual: torch.Tensor) -> float:
    """First Block Cache's measure: how much the first block's residual changed since the cached one.

    δ = mean|residual − cached_residual| / mean|cached_residual|, over every element (a relative L1 change).

    Graded against: FBCHeadBlockHook._should_compute_remaining_blocks (diffusers/hooks/first_block_cache.py),
    the δ it compares with the threshold.
    Args:
        residual:        (B, N, D) the first block's output − its input at this step, float32 or float64.
        cached_residual: (B, N, D) the same at the last step that ran every block.
    Returns: δ as a Python float.
    """
    # TODO: mean absolute difference over the mean absolute cached residual
    raise NotImplementedError


def first_block_cache_step(blocks, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                           temb: torch.Tensor, image_rotary_emb, cache: dict | None,
                           threshold: float) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One transformer call's blocks with First Block Cache: run the first block, then all the others or
    none of them.

    Compute every block when `cache` is None (nothing cached yet) or residual_change(r, cache["head_residual"])
    > threshold, where r = the first block's hidden_states output − hidden_states. Otherwise skip blocks[1:]
    and add the cached tail residuals to the first block's outputs.

    Graded against: FluxTransformer2DModel.enable_cache(FirstBlockCacheConfig(threshold)) (diffusers'
    FBCHeadBlockHook and FBCBlockHook) on a tiny Flux transformer, call by call through a sampling run, each
    call given the cache diffusers held before it.
    Args:
        blocks:                a ModuleList of N ≥ 2 Flux blocks, called as in `run_blocks`.
        hidden_states:         (B, S_img, D) image tokens entering the first block.
        encoder_hidden_states: (B, S_txt, D) text tokens entering the first block.
        temb, image_rotary_emb: passed to every block as they are ((B, D); a (cos, sin) pair).
        cache:                 None, or the dict this function returned at the previous call:
            head_residual:  (B, S_img, D) the first block's residual at the last step that ran every block
            head_output:    (hidden_states, encoder_hidden_states) the first block returned at that step
            tail_residuals: (last block's hidden_states − first block's, the same for encoder_hidden_states)
            should_compute: whether that previous call ran every block (not used to decide)
        threshold:             skip when δ ≤ threshold.
    Returns: (hidden_states, encoder_hidden_states, new cache): a computed step fills every key from this step;
        a skipped one keeps the three tensor entries of `cache` and sets should_compute False. Build a new
        dict rather than changing `cache` (the caller may still hold the old one).
    """
    # TODO: first block; δ against the cached residual; all blocks and a fresh cache, or the cached tail
    raise NotImplementedError


def cached_transformer_calls(blocks, calls: list[dict], threshold: float) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """One generation's transformer calls through First Block Cache, each context with its own cache.

    Graded against: the same hooked tiny Flux transformer run as FluxPipeline runs it, each call under
    transformer.cache_context(call["context"]) (true CFG: "cond" then "uncond" at every step), all caches
    empty at the start.
    Args:
        blocks:    as in `first_block_cache_step`.
        calls:     in order, each a dict with "context" ("cond" or "uncond"), "hidden_states",
                   "encoder_hidden_states", "temb" and "image_rotary_emb" (the first block's inputs).
        threshold: as in `first_block_cache_step`.
    Returns: per call, (hidden_states, encoder_hidden_states, computed): the blocks' outputs and whether
        that call ran every block.
    """
    # TODO: one cache per context name, each call through first_block_cache_step
    raise NotImplementedError
