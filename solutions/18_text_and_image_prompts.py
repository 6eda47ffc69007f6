"""Lab 18 · Text and image prompts

Concept:
    A prompt reaches the UNet as a (B, 77, 768) tensor of token features, not as a sentence: the tokenizer
    turns it into ids (BOS, the prompt, EOS, then padding up to max_length: every prompt the same length),
    CLIP's text encoder turns the ids into one hidden state per token, and every cross-attention layer of
    the UNet attends to those. Which hidden state a pipeline hands over is a choice (clip_skip), the pooled
    vector (SDXL's extra conditioning) is one row of it, and classifier-free guidance needs a second,
    negative branch batched in front. An IP-Adapter adds an image prompt without touching the text path:
    each cross-attention layer gets a second, decoupled attention over image tokens, with its own key and
    value projections, added on top with a scale.

Mental model:
    - ids = [BOS, tokens…, EOS, pad, pad, …] (padding="max_length", truncation keeps BOS … EOS).
    - text_encoder(ids, output_hidden_states=True).hidden_states = (embeddings, layer 1, …, layer L), all
      before the final layer norm; last_hidden_state = final_layer_norm(hidden_states[-1]).
      clip_skip = k: final_layer_norm(hidden_states[-(k + 1)]) (skip the last k layers, then normalise).
    - pooled = last_hidden_state[b, position of EOS]: the first index where ids == eos_token_id, or, for
      configs with the legacy eos_token_id 2, argmax(ids) (EOS is CLIP's highest id).
    - CFG batch = cat([negative, positive]), each (B, L, D) → (B·n, L, D) prompt by prompt (p0 p0 p1 p1);
      an empty negative prompt is still a prompt: "" → [BOS, EOS, pad, …] → its own features.
    - IP-Adapter (decoupled cross-attention), q = to_q(x):
          o = Attn(q, to_k(text), to_v(text)) + Σ_i scale_i · Attn(q, to_k_ip[i](img_i), to_v_ip[i](img_i))
          out = to_out(o)
      encoder_hidden_states = [text tokens, image tokens of adapter 1, adapter 2, …]: split at the end.
      set_ip_adapter_scale(s) sets the scale_i of every layer; scale 0 gives plain text attention.

Traps:
    - clip_skip set but last_hidden_state used; or the picked hidden state not normalised (the UNet was
      trained on final_layer_norm'ed features); or hidden_states[-k] (one layer too late).
    - Pooling from the last position (padding) or from BOS; argmax(ids) under a new config whose vocabulary
      grew (textual inversion puts ids above EOS); the last EOS where padding is EOS too.
    - CFG batch [positive, negative]: the pipeline chunks the UNet output as (uncond, text). Negatives not
      repeated per image; the batch tiled (p0 p1 p0 p1) instead of grouped.
    - SD's encode_prompt encodes the NEGATIVE prompt from last_hidden_state even when clip_skip is set:
      applying clip_skip to both branches is a different pipeline.
    - IP-Adapter: image tokens concatenated into the text keys (one softmax: image and text then compete
      for weight), the scale on both terms, image tokens through the text projections to_k / to_v.

Precision:
    The course's one policy (lab 01 states it): return the dtype the docstring names and compute as wide as
    you like; the graders compare against exact float64 math (the same diffusers / transformers code on a
    float64 copy of the model) and accept anything about as close to it as diffusers' own answer.

Say it out loud:
    "The pipeline tokenizes to a fixed length, runs CLIP and hands the UNet the final-normed last hidden
    state, or with clip_skip k the hidden state k layers earlier, normalised the same way. The pooled vector
    is the EOS token's row. For guidance it encodes the negative prompt, empty or not, repeats both per
    image and stacks negatives first. An IP-Adapter adds, in every cross-attention, a second attention of
    the same queries over image tokens with its own K/V weights, times a scale, so text and image never
    compete inside one softmax."

Graded against: StableDiffusionPipeline.encode_prompt (with and without clip_skip, num_images_per_prompt,
negative or empty prompts, and the [negative, positive] batch of __call__) on a tiny offline CLIP stack;
CLIPTextModel's pooler_output (legacy and current configs); IPAdapterAttnProcessor2_0 on a tiny Attention
(one adapter, concatenated tokens; two adapters with their own scales; scale 0; float16), on fresh
seeded inputs.
Run: python -m pytest katas/18_text_and_image_prompts.py
"""
import torch
import torch.nn.functional as F


# ---- Worked example --------------------------------------------------------------------------------
def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, S, H·d) → (B, H, S, d): the layout scaled_dot_product_attention works in."""
    batch, tokens, inner = x.shape
    return x.view(batch, tokens, heads, inner // heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, S, d) → (B, S, H·d)."""
    batch, heads, tokens, dim = x.shape
    return x.transpose(1, 2).reshape(batch, tokens, heads * dim)


# ---- Your turn -------------------------------------------------------------------------------------
def prompt_embeds(text_encoder, input_ids: torch.Tensor, clip_skip: int | None = None) -> torch.Tensor:
    """The text features a Stable Diffusion pipeline hands its UNet.

    Graded against: StableDiffusionPipeline.encode_prompt(prompt, cpu, 1, False, clip_skip=clip_skip)
    Args:
        text_encoder: a transformers CLIPTextModel (its final layer norm is text_encoder.final_layer_norm;
                      diffusers' source spells it text_encoder.text_model.final_layer_norm, which transformers
                      5 no longer has)
        input_ids:    (B, L) int64 token ids, padded to max_length (BOS … EOS, pad)
        clip_skip:    None (the last layer), or k ≥ 1: skip the last k layers
    Returns: (B, L, D) float32.
    """
    # BEGIN SOLUTION: last_hidden_state, or final_layer_norm(hidden_states[-(clip_skip + 1)])
    with torch.no_grad():
        out = text_encoder(input_ids, output_hidden_states=True)
        if clip_skip is None:
            return out.last_hidden_state
        return text_encoder.final_layer_norm(out.hidden_states[-(clip_skip + 1)])
    # END SOLUTION


def pooled_embedding(last_hidden_state: torch.Tensor, input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """CLIP's pooled output: each prompt's EOS row of last_hidden_state.

    Graded against: CLIPTextModel(input_ids).pooler_output
    Args:
        last_hidden_state: (B, L, D) the encoder's output
        input_ids:         (B, L) int64 ids (padding may be EOS itself, or another token)
        eos_token_id:      the config's eos_token_id (2 in legacy configs: then EOS is the highest id)
    Returns: (B, D), dtype of last_hidden_state.
    """
    # BEGIN SOLUTION: the row of the first EOS (argmax of the ids for the legacy eos_token_id 2)
    if eos_token_id == 2:
        position = input_ids.argmax(-1)
    else:
        position = (input_ids == eos_token_id).int().argmax(-1)
    return last_hidden_state[torch.arange(last_hidden_state.shape[0]), position]
    # END SOLUTION


def cfg_text_batch(text_encoder, input_ids: torch.Tensor, negative_input_ids: torch.Tensor,
                   num_images_per_prompt: int, clip_skip: int | None = None) -> torch.Tensor:
    """The text batch of a guided Stable Diffusion step: negatives first, then positives, each prompt
    repeated num_images_per_prompt times in place.

    Graded against: torch.cat([neg, pos]) with pos, neg = StableDiffusionPipeline.encode_prompt(prompt,
    cpu, n, True, negative_prompt=…, clip_skip=…) (what __call__ builds)
    Args:
        text_encoder:          a CLIPTextModel
        input_ids:             (B, L) the prompts' ids
        negative_input_ids:    (B, L) the negative prompts' ids ("" when no negative prompt was given)
        num_images_per_prompt: n
        clip_skip:             as in prompt_embeds; SD's encode_prompt applies it to the positive branch only
    Returns: (2·B·n, L, D) float32.
    """
    # BEGIN SOLUTION: positives with clip_skip, negatives from the last hidden state, both repeated per image, [neg, pos]
    n = num_images_per_prompt
    positive = prompt_embeds(text_encoder, input_ids, clip_skip).repeat_interleave(n, 0)
    negative = prompt_embeds(text_encoder, negative_input_ids, None).repeat_interleave(n, 0)
    return torch.cat([negative, positive])
    # END SOLUTION


def ip_adapter_attention(attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                         num_tokens: list[int], to_k_ip, to_v_ip, scale: list[float]) -> torch.Tensor:
    """IP-Adapter's decoupled cross-attention: the text attention plus, per adapter, scale · an attention of
    the same queries over that adapter's image tokens with its own key/value projections.

    Graded against: IPAdapterAttnProcessor2_0(...)(attn, hidden_states, encoder_hidden_states)
    Args:
        attn:                  a diffusers Attention (to_q, to_k, to_v, to_out = [Linear, Dropout], heads)
        hidden_states:         (B, N, C) the queries' tokens
        encoder_hidden_states: (B, M_text + Σ num_tokens, C_cross): text tokens, then each adapter's image tokens
        num_tokens:            image tokens per adapter, in order
        to_k_ip, to_v_ip:      per adapter, its key / value Linear (C_cross → H·d)
        scale:                 per adapter, its weight (set_ip_adapter_scale); 0 adds nothing
    Returns: (B, N, H·d), dtype of the inputs.
    """
    # BEGIN SOLUTION: split off the image tokens at the end; text attention + Σ scale·image attention; to_out
    heads = attn.heads
    text_len = encoder_hidden_states.shape[1] - sum(num_tokens)
    text = encoder_hidden_states[:, :text_len]
    images = torch.split(encoder_hidden_states[:, text_len:], list(num_tokens), dim=1)
    with torch.no_grad():
        q = split_heads(attn.to_q(hidden_states), heads)
        out = merge_heads(F.scaled_dot_product_attention(
            q, split_heads(attn.to_k(text), heads), split_heads(attn.to_v(text), heads)))
        for image, to_k, to_v, s in zip(images, to_k_ip, to_v_ip, scale):
            if s == 0:
                continue
            ip = F.scaled_dot_product_attention(q, split_heads(to_k(image), heads), split_heads(to_v(image), heads))
            out = out + s * merge_heads(ip)
        return attn.to_out[1](attn.to_out[0](out))
    # END SOLUTION
