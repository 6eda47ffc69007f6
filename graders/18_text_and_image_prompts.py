"""Grader for lab 18 · Text and image prompts: the hidden state a pipeline uses (clip_skip), the pooled
output, the CFG text batch, and IP-Adapter's decoupled cross-attention.

References are live: StableDiffusionPipeline.encode_prompt on a tiny pipeline built from components with a
character-level CLIPTokenizer (offline vocabulary: the 256 byte characters, their "</w>" forms, BOS, EOS)
and a random CLIPTextModel (hidden 32, 3 layers, 32 positions); CLIPTextModel's own pooler_output; and
IPAdapterAttnProcessor2_0 on a tiny `Attention` (the text-then-image concatenation, split by diffusers
itself, for one adapter; the (text, [images…]) tuple for two).

transformers 5 flattened CLIPTextModel (no `.text_model`: its final_layer_norm is an attribute of the model
itself) while diffusers 0.42.1's encode_prompt still reads `text_encoder.text_model.final_layer_norm` when
clip_skip is set. The reference pipeline's text encoder therefore carries a plain (non-module) alias
`text_model` holding the same final_layer_norm: the same weights, the same call.

Precision: every float check carries its float64 shadow (Scenario.exact): the same diffusers code on a
float64 copy of the model and the same inputs. An answer about as close to exact math as diffusers' passes.
"""
import copy
import types
import warnings

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention, IPAdapterAttnProcessor2_0
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import StableDiffusionPipeline
from diffusers.schedulers.scheduling_ddim import DDIMScheduler

from diffusion_katas.core.spec import Kata, Scenario
from diffusion_katas.core.tolerances import EXACT, MODEL_FORWARD
from diffusion_katas.engine import tiny
from diffusion_katas.engine.helpers import DTYPES, SD_BETAS, quiet_diffusers

CPU = torch.device("cpu")
PIPELINE = "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion.StableDiffusionPipeline"
IP_PROCESSOR = "diffusers.models.attention_processor.IPAdapterAttnProcessor2_0.__call__"
ATTENTION = "diffusers.models.attention_processor.Attention.forward"
MAX_LENGTH = tiny.CLIP_MAX_LENGTH
WORDS = ["a", "cat", "red", "fox", "in", "the", "snow", "photo", "of", "blue", "sky", "oil", "painting", "zebra"]


# ---- the tiny text stack ------------------------------------------------------------------------------
def _register_clip_outputs() -> None:
    """transformers 5 registers what a model class can record (hidden_states, attentions) when an instance
    is built, in a per-process table keyed by class; a model that arrives pickled in a process that never
    built one returns hidden_states=None. The learner's runner imports this grader before it unpickles the
    encoder, so build one throwaway CLIPTextModel here (under a forked RNG: no seed moves)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    with torch.random.fork_rng(devices=[]):
        CLIPTextModel(CLIPTextConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                     num_attention_heads=2, max_position_embeddings=4))


_register_clip_outputs()


# A character-level CLIPTokenizer built offline (EOS the highest id and the padding token, as in SD 1.x).
tokenizer = tiny.clip_tokenizer


def text_encoder(g: torch.Generator, *, layers: int = 3, legacy_eos: bool = False):
    """A random CLIPTextModel for the tokenizer above; legacy_eos: eos_token_id = 2 in the config (the
    pre-2023 CLIP configs, whose pooled output takes the argmax of the ids)."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
    model = tiny.clip_text_encoder(layers, eos_token_id=2 if legacy_eos else None)
    # encode_prompt(clip_skip=…) reads text_encoder.text_model.final_layer_norm (transformers 4's layout)
    object.__setattr__(model, "text_model", types.SimpleNamespace(final_layer_norm=model.final_layer_norm))
    return model


def text_pipeline(encoder) -> StableDiffusionPipeline:
    with quiet_diffusers(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = StableDiffusionPipeline(vae=tiny.vae(), text_encoder=encoder, tokenizer=tokenizer(),
                                       unet=tiny.unet_cond(), scheduler=DDIMScheduler(**SD_BETAS),
                                       safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    return pipe


def prompts(n: int, g: torch.Generator, *, words=(1, 4), long: bool = False) -> list[str]:
    out = []
    for _ in range(n):
        k = 12 if long else int(torch.randint(words[0], words[1] + 1, (1,), generator=g))
        out.append(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=g)))
    return out


def ids_of(texts: list[str], max_length: int = MAX_LENGTH) -> torch.Tensor:
    """What encode_prompt feeds the text encoder: padded to max_length, truncated (BOS … EOS)."""
    return tokenizer()(texts, padding="max_length", max_length=max_length, truncation=True,
                       return_tensors="pt").input_ids


def fresh(encoder):
    """A copy of the encoder that has never run: transformers installs an output-capturing hook (a local
    function, which cannot be pickled to the learner's runner) on a model's first forward."""
    from transformers import CLIPTextModel

    copy_ = CLIPTextModel(encoder.config).eval()
    copy_.load_state_dict(encoder.state_dict())
    return copy_


def wide(encoder):
    w = copy.deepcopy(encoder).to(torch.float64)
    object.__setattr__(w, "text_model", types.SimpleNamespace(final_layer_norm=w.final_layer_norm))
    return w


def _hidden(encoder, ids, clip_skip):
    with torch.no_grad():
        out = encoder(ids, output_hidden_states=True)
        if clip_skip is None:
            return out.last_hidden_state
        return encoder.final_layer_norm(out.hidden_states[-(clip_skip + 1)])


# ---- prompt_embeds ----------------------------------------------------------------------------------
prompt_embeds = Kata(
    "prompt_embeds",
    hints=(
        "Without clip_skip the pipeline uses the encoder's last_hidden_state (after the final layer norm). "
        "With clip_skip it reaches back into the stack of hidden states, and normalises that one too.",
        "hidden_states = (embeddings, layer 1, …, layer L) before the final norm: clip_skip = k picks "
        "hidden_states[-(k + 1)], then final_layer_norm; clip_skip None → last_hidden_state.",
        "out = text_encoder(input_ids, output_hidden_states=True); if clip_skip is None: return "
        "out.last_hidden_state; return text_encoder.final_layer_norm(out.hidden_states[-(clip_skip + 1)])",
    ),
    answer_key=(f"{PIPELINE}.encode_prompt", f"{PIPELINE}._encode_prompt"),
)

EMBED_CASES = [
    dict(batch=2, clip_skip=None, layers=3),
    dict(batch=3, clip_skip=2, layers=3),  # first: at clip_skip 1, hidden_states[-1] IS the last layer
    dict(batch=2, clip_skip=1, layers=3),
    dict(batch=1, clip_skip=1, layers=2, long=True),  # truncated at 32 tokens
    dict(batch=2, clip_skip=2, layers=2),  # reaches back to the embeddings themselves
]


def _label(case, ids):
    return f"B={ids.shape[0]}, {ids.shape[1]} tokens, clip_skip={case.get('clip_skip')}, {case['layers']} layers"


@prompt_embeds.check("vs encode_prompt(prompt, clip_skip=…)", cases=EMBED_CASES, tol=MODEL_FORWARD)
def _(case, g):
    encoder = text_encoder(g, layers=case["layers"])
    texts = prompts(case["batch"], g, long=case.get("long", False))
    pipe = text_pipeline(encoder)
    with torch.no_grad():
        expected, _ = pipe.encode_prompt(texts, CPU, 1, False, clip_skip=case["clip_skip"])
    ids = ids_of(texts)
    return Scenario(inputs=dict(text_encoder=fresh(encoder), input_ids=ids, clip_skip=case["clip_skip"]),
                    expected=expected, exact=_hidden(wide(encoder), ids, case["clip_skip"]),
                    label=f"{_label(case, ids)}, prompts {texts}")


@prompt_embeds.trap("last hidden state used although clip_skip is set",
                    hint="clip_skip = k means: skip the last k layers. Take hidden_states[-(k + 1)] (with "
                         "output_hidden_states=True), not last_hidden_state.")
def _(text_encoder, input_ids, clip_skip=None):
    return _hidden(text_encoder, input_ids, None)


@prompt_embeds.trap("final layer norm skipped after clip_skip",
                    hint="hidden_states[i] are the raw residual streams; the UNet was trained on normalised "
                         "features: apply text_encoder.final_layer_norm to the one you pick.")
def _(text_encoder, input_ids, clip_skip=None):
    with torch.no_grad():
        out = text_encoder(input_ids, output_hidden_states=True)
    return out.last_hidden_state if clip_skip is None else out.hidden_states[-(clip_skip + 1)]


@prompt_embeds.trap("hidden_states[-clip_skip] (one layer too late)",
                    hint="hidden_states[-1] is the last layer's output (clip_skip 0): clip_skip = k is "
                         "hidden_states[-(k + 1)].")
def _(text_encoder, input_ids, clip_skip=None):
    with torch.no_grad():
        out = text_encoder(input_ids, output_hidden_states=True)
        return out.last_hidden_state if clip_skip is None else text_encoder.final_layer_norm(
            out.hidden_states[-clip_skip])


@prompt_embeds.trap("final layer norm applied to last_hidden_state too (normalised twice without clip_skip)",
                    hint="last_hidden_state has already been through final_layer_norm: return it as it is when "
                         "clip_skip is None; only a hidden_states[i] you pick needs the norm.")
def _(text_encoder, input_ids, clip_skip=None):
    with torch.no_grad():
        out = text_encoder(input_ids, output_hidden_states=True)
        picked = out.last_hidden_state if clip_skip is None else out.hidden_states[-(clip_skip + 1)]
        return text_encoder.final_layer_norm(picked)


# ---- pooled_embedding -------------------------------------------------------------------------------
pooled_embedding = Kata(
    "pooled_embedding",
    hints=(
        "The pooled vector is one row of last_hidden_state per prompt: the EOS token's, the one token "
        "that has attended to the whole prompt (CLIP's mask is causal).",
        "Legacy configs (eos_token_id == 2): position = argmax(input_ids) (EOS is the highest id); "
        "otherwise position = the FIRST index where input_ids == eos_token_id (padding may be EOS too).",
        "pos = input_ids.argmax(-1) if eos_token_id == 2 else (input_ids == eos_token_id).int().argmax(-1); "
        "return last_hidden_state[torch.arange(len(pos)), pos]",
    ),
    answer_key=("transformers.models.clip.modeling_clip.CLIPTextModel.forward",),
)

POOL_CASES = [
    dict(batch=3, legacy_eos=False, pad="eos"),
    dict(batch=2, legacy_eos=True, pad="eos"),
    dict(batch=2, legacy_eos=False, pad="!"),  # SD 2.x pads with "!" (id 0), not EOS
    dict(batch=3, legacy_eos=False, pad="eos", added_token=True),  # a textual-inversion id above EOS
    dict(batch=2, legacy_eos=True, pad="!"),
]


@pooled_embedding.check("vs CLIPTextModel(...).pooler_output", cases=POOL_CASES, tol=EXACT)
def _(case, g):
    encoder = text_encoder(g, legacy_eos=case["legacy_eos"])
    tok = tokenizer()
    texts = prompts(case["batch"], g)
    if case["legacy_eos"]:  # "##" holds id 2 ("#" inside a word): under the legacy config, ids == 2 is not EOS
        texts = ["##" + t for t in texts]
    ids = ids_of(texts)
    if case["pad"] == "!":
        after = torch.cumsum((ids == tok.eos_token_id).int(), -1) > 1
        ids = ids.masked_fill(after, tok.convert_tokens_to_ids("!"))
    if case.get("added_token"):
        # the vocabulary grew (textual inversion): a new token, id above EOS, in each prompt
        encoder.resize_token_embeddings(encoder.config.vocab_size + 1)
        ids[:, 1] = encoder.config.vocab_size - 1
    with torch.no_grad():
        out = encoder(ids)
    eos = encoder.config.eos_token_id
    return Scenario(inputs=dict(last_hidden_state=out.last_hidden_state, input_ids=ids, eos_token_id=eos),
                    expected=out.pooler_output, exact=out.pooler_output.double(),
                    label=f"eos_token_id={eos}, padding {case['pad']!r}, ids {ids[0].tolist()}")


def _at(h, pos):
    return h[torch.arange(h.shape[0]), pos]


@pooled_embedding.trap("pooled from the last position (where padding is EOS, that is also the last EOS)",
                       hint="The last position is padding: the pooled row is the EOS token's, which sits "
                            "right after the prompt's last character. Where the padding token is EOS itself, "
                            "the last EOS is the last position too: take the FIRST EOS.")
def _(last_hidden_state, input_ids, eos_token_id):
    return last_hidden_state[:, -1]


@pooled_embedding.trap("pooled from the first token (BOS)",
                       hint="Position 0 is BOS: with a causal mask it has seen nothing but itself. Take the "
                            "EOS token's row.")
def _(last_hidden_state, input_ids, eos_token_id):
    return last_hidden_state[:, 0]


@pooled_embedding.trap("argmax of the ids whatever the config",
                       hint="argmax(ids) finds EOS only while EOS is the highest id: an added token (textual "
                            "inversion) breaks it. With eos_token_id ≠ 2, find the first ids == eos_token_id.")
def _(last_hidden_state, input_ids, eos_token_id):
    return _at(last_hidden_state, input_ids.argmax(-1))


@pooled_embedding.trap("ids == eos_token_id under the legacy config (eos_token_id 2)",
                       hint="A config with eos_token_id == 2 predates the fix: there transformers takes "
                            "argmax(ids) (EOS is the highest id in CLIP's vocabulary), not ids == 2.")
def _(last_hidden_state, input_ids, eos_token_id):
    return _at(last_hidden_state, (input_ids == eos_token_id).int().argmax(-1))


@pooled_embedding.trap("the last EOS (padding) instead of the first",
                       hint="When padding is EOS too, every pad position equals eos_token_id: the first one "
                            "is the real end of the prompt.")
def _(last_hidden_state, input_ids, eos_token_id):
    hit = (input_ids == (input_ids.max() if eos_token_id == 2 else eos_token_id)).int()
    last = hit.shape[-1] - 1 - hit.flip(-1).argmax(-1)
    return _at(last_hidden_state, last)


# ---- cfg_text_batch ---------------------------------------------------------------------------------
cfg_text_batch = Kata(
    "cfg_text_batch",
    hints=(
        "The UNet sees one batch: all negative (unconditional) rows first, then all positive rows, each "
        "prompt repeated num_images_per_prompt times in place.",
        "pos = embeds(ids, clip_skip), neg = embeds(negative ids) from the LAST hidden state (SD's "
        "encode_prompt ignores clip_skip for negatives); each (B, L, D) → (B·n, L, D) prompt by prompt; "
        "return cat([neg, pos]).",
        "pos = prompt_embeds(text_encoder, input_ids, clip_skip).repeat_interleave(n, 0); "
        "neg = text_encoder(negative_input_ids).last_hidden_state.repeat_interleave(n, 0); "
        "return torch.cat([neg, pos])",
    ),
    answer_key=(f"{PIPELINE}.encode_prompt", f"{PIPELINE}._encode_prompt"),
)

CFG_CASES = [
    dict(batch=2, n=1, clip_skip=None, negative="empty"),
    dict(batch=2, n=3, clip_skip=None, negative="prompts"),
    dict(batch=1, n=2, clip_skip=1, negative="empty", layers=2),
    dict(batch=3, n=2, clip_skip=2, negative="prompts"),
]


@cfg_text_batch.check("vs encode_prompt(prompt, negative_prompt, do_classifier_free_guidance=True)",
                      cases=CFG_CASES, tol=MODEL_FORWARD)
def _(case, g):
    encoder = text_encoder(g, layers=case.get("layers", 3))
    texts = prompts(case["batch"], g)
    negatives = None if case["negative"] == "empty" else prompts(case["batch"], g, words=(1, 3))
    pipe = text_pipeline(encoder)
    with torch.no_grad():
        pos, neg = pipe.encode_prompt(texts, CPU, case["n"], True, negative_prompt=negatives,
                                      clip_skip=case["clip_skip"])
        expected = torch.cat([neg, pos])  # StableDiffusionPipeline.__call__'s CFG batch
        w = wide(encoder)
        ids, nids = ids_of(texts), ids_of(negatives or [""] * case["batch"])
        exact = torch.cat([w(nids).last_hidden_state.repeat_interleave(case["n"], 0),
                           _hidden(w, ids, case["clip_skip"]).repeat_interleave(case["n"], 0)])
    return Scenario(inputs=dict(text_encoder=fresh(encoder), input_ids=ids, negative_input_ids=nids,
                                num_images_per_prompt=case["n"], clip_skip=case["clip_skip"]),
                    expected=expected, exact=exact,
                    label=f"B={case['batch']}, n={case['n']}, clip_skip={case['clip_skip']}, negative "
                          f"{'empty prompt' if negatives is None else negatives}")


def _cfg(text_encoder, input_ids, negative_input_ids, n, clip_skip, *, order="neg", repeat="interleave",
         neg_skip=False):
    pos = _hidden(text_encoder, input_ids, clip_skip)
    neg = _hidden(text_encoder, negative_input_ids, clip_skip if neg_skip else None)
    rep = (lambda t: t.repeat_interleave(n, 0)) if repeat == "interleave" else (
        (lambda t: t.repeat(n, 1, 1)) if repeat == "tile" else (lambda t: t))
    pos = pos.repeat_interleave(n, 0) if repeat != "tile" else pos.repeat(n, 1, 1)
    neg = rep(neg)
    return torch.cat([pos, neg]) if order == "pos" else torch.cat([neg, pos])


@cfg_text_batch.trap("CFG batch ordered [positive, negative]",
                     hint="StableDiffusionPipeline concatenates [negative, positive] and chunks the UNet output "
                          "as (uncond, text) in that order: negatives first.")
def _(text_encoder, input_ids, negative_input_ids, num_images_per_prompt, clip_skip=None):
    return _cfg(text_encoder, input_ids, negative_input_ids, num_images_per_prompt, clip_skip, order="pos")


@cfg_text_batch.trap("negative embeds not repeated per image",
                     hint="Both halves must have B·n rows: repeat the negatives per image exactly like the "
                          "positives.")
def _(text_encoder, input_ids, negative_input_ids, num_images_per_prompt, clip_skip=None):
    return _cfg(text_encoder, input_ids, negative_input_ids, num_images_per_prompt, clip_skip, repeat="none")


@cfg_text_batch.trap("the batch tiled (p0, p1, p0, p1) instead of per prompt",
                     hint="Each prompt's copies sit together (p0, p0, p1, p1): repeat along the tokens then "
                          "view, or repeat_interleave(n, 0); repeat(n, 1, 1) tiles.")
def _(text_encoder, input_ids, negative_input_ids, num_images_per_prompt, clip_skip=None):
    return _cfg(text_encoder, input_ids, negative_input_ids, num_images_per_prompt, clip_skip, repeat="tile")


@cfg_text_batch.trap("clip_skip applied to the negative prompt too",
                     hint="SD's encode_prompt encodes the negative prompt from the last hidden state, clip_skip "
                          "or not (only the positive branch reads hidden_states): match the pipeline.")
def _(text_encoder, input_ids, negative_input_ids, num_images_per_prompt, clip_skip=None):
    return _cfg(text_encoder, input_ids, negative_input_ids, num_images_per_prompt, clip_skip, neg_skip=True)


# ---- ip_adapter_attention ---------------------------------------------------------------------------
ip_adapter_attention = Kata(
    "ip_adapter_attention",
    hints=(
        "Two attentions with the SAME query, summed: one over the text tokens with the layer's to_k/to_v, "
        "one per adapter over its image tokens with that adapter's own to_k_ip/to_v_ip, times its scale.",
        "Split encoder_hidden_states at the end: text = [:, :M − Σ num_tokens], then each adapter's block. "
        "o = Attn(q, K_txt, V_txt) + Σ_i scale_i·Attn(q, K_img_i, V_img_i) (heads split, merged); "
        "out = to_out(o). A scale of 0 adds nothing.",
        "q = split_heads(attn.to_q(x)); o = merge(sdpa(q, split_heads(attn.to_k(txt)), split_heads(attn.to_v(txt)))); "
        "for img, k_ip, v_ip, s in zip(images, to_k_ip, to_v_ip, scale): o = o + s * merge(sdpa(q, "
        "split_heads(k_ip(img)), split_heads(v_ip(img)))); return attn.to_out[1](attn.to_out[0](o))",
    ),
    answer_key=(IP_PROCESSOR, ATTENTION),
)

IP_CASES = [
    dict(batch=2, query_tokens=12, text_tokens=7, num_tokens=[4], scale=[1.0], heads=2, head_dim=8,
         dtype="float32"),
    dict(batch=3, query_tokens=9, text_tokens=5, num_tokens=[4], scale=[0.6], heads=4, head_dim=4,
         dtype="float32"),
    dict(batch=2, query_tokens=8, text_tokens=6, num_tokens=[4], scale=[0.0], heads=2, head_dim=8,
         dtype="float32"),  # scale 0: plain text attention
    dict(batch=2, query_tokens=10, text_tokens=7, num_tokens=[4, 16], scale=[0.5, 0.8], heads=2, head_dim=8,
         dtype="float32"),  # two adapters (IP-Adapter and IP-Adapter Plus), their own scales
    dict(batch=1, query_tokens=16, text_tokens=5, num_tokens=[2, 3], scale=[0.0, 1.2], heads=1, head_dim=16,
         dtype="float32"),
    dict(batch=2, query_tokens=12, text_tokens=7, num_tokens=[4], scale=[0.7], heads=2, head_dim=8,
         dtype="float16"),
]


def tiny_ip_attention(case, g):
    dim, cross = case["heads"] * case["head_dim"], 24
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
    attn = Attention(query_dim=dim, cross_attention_dim=cross, heads=case["heads"], dim_head=case["head_dim"])
    proc = IPAdapterAttnProcessor2_0(hidden_size=dim, cross_attention_dim=cross, num_tokens=case["num_tokens"],
                                     scale=case["scale"])
    attn.set_processor(proc)
    dtype = DTYPES[case["dtype"]]
    return attn.eval().to(dtype), proc.to(dtype), cross


def _run_ip(attn, proc, x, text, images):
    with torch.no_grad(), warnings.catch_warnings(), quiet_diffusers():
        warnings.simplefilter("ignore")
        if len(images) == 1:  # the concatenated form: diffusers splits it itself
            return proc(attn, x, torch.cat([text, images[0]], 1))
        return proc(attn, x, (text, images))


@ip_adapter_attention.check("vs IPAdapterAttnProcessor2_0", cases=IP_CASES, tol=MODEL_FORWARD)
def _(case, g):
    attn, proc, cross = tiny_ip_attention(case, g)
    dtype, dim = DTYPES[case["dtype"]], case["heads"] * case["head_dim"]
    x = torch.randn(case["batch"], case["query_tokens"], dim, generator=g).to(dtype)
    text = torch.randn(case["batch"], case["text_tokens"], cross, generator=g).to(dtype)
    images = [torch.randn(case["batch"], n, cross, generator=g).to(dtype) for n in case["num_tokens"]]
    expected = _run_ip(attn, proc, x.clone(), text.clone(), [i.clone() for i in images])
    wide_attn = copy.deepcopy(attn).to(torch.float64)
    exact = _run_ip(wide_attn, wide_attn.processor, x.double(), text.double(), [i.double() for i in images])
    return Scenario(
        inputs=dict(attn=attn, hidden_states=x, encoder_hidden_states=torch.cat([text, *images], 1),
                    num_tokens=list(case["num_tokens"]), to_k_ip=proc.to_k_ip, to_v_ip=proc.to_v_ip,
                    scale=list(case["scale"])),
        expected=expected, exact=exact,
        label=f"B={case['batch']}, {case['query_tokens']} queries, {case['text_tokens']} text + "
              f"{case['num_tokens']} image tokens, H={case['heads']}, scale={case['scale']}")


def _h(t, heads):
    b, s, inner = t.shape
    return t.view(b, s, heads, inner // heads).transpose(1, 2)


def _m(t):
    b, h, s, d = t.shape
    return t.transpose(1, 2).reshape(b, s, h * d)


def _ip(attn, x, ehs, num_tokens, to_k_ip, to_v_ip, scale, *, one_softmax=False, scale_both=False,
        text_proj=False, split_front=False, last_n=False, blend=False, groups_from_end=False, one_head=False,
        scaled_values=False):
    heads = 1 if one_head else attn.heads
    with torch.no_grad():
        m = ehs.shape[1] - sum(num_tokens)
        if split_front:
            images = list(torch.split(ehs[:, :sum(num_tokens)], num_tokens, 1))
            text = ehs[:, sum(num_tokens):]
        else:
            text, images = ehs[:, :m], list(torch.split(ehs[:, m:], num_tokens, 1))
        if last_n:
            images = [ehs[:, -n:] for n in num_tokens]
        if groups_from_end:  # adapter 0 the last num_tokens[0] tokens, adapter 1 the ones before them, …
            images = list(torch.split(ehs[:, m:], num_tokens[::-1], 1))[::-1]
        q = _h(attn.to_q(x), heads)
        if one_softmax:
            k = torch.cat([attn.to_k(text)] + [k_ip(i) for i, k_ip in zip(images, to_k_ip)], 1)
            v = torch.cat([attn.to_v(text)] + [v_ip(i) * (s if scaled_values else 1)
                                               for i, v_ip, s in zip(images, to_v_ip, scale)], 1)
            o = _m(F.scaled_dot_product_attention(q, _h(k, heads), _h(v, heads)))
        else:
            o = _m(F.scaled_dot_product_attention(q, _h(attn.to_k(text), heads), _h(attn.to_v(text), heads)))
            if scale_both:
                o = o * scale[0]
            for img, k_ip, v_ip, s in zip(images, to_k_ip, to_v_ip, scale):
                kp, vp = (attn.to_k, attn.to_v) if text_proj else (k_ip, v_ip)
                attended = _m(F.scaled_dot_product_attention(q, _h(kp(img), heads), _h(vp(img), heads)))
                o = (1 - s) * o + s * attended if blend else o + s * attended
        return attn.to_out[1](attn.to_out[0](o))


@ip_adapter_attention.trap("image tokens concatenated into the text K/V (one softmax)",
                           hint="Decoupled cross-attention keeps two softmaxes: the image tokens do not compete "
                                "with the text tokens for attention weight. Attend to each separately and add.")
def _(attn, hidden_states, encoder_hidden_states, num_tokens, to_k_ip, to_v_ip, scale):
    return _ip(attn, hidden_states, encoder_hidden_states, num_tokens, to_k_ip, to_v_ip, scale, one_softmax=True)


@ip_adapter_attention.trap("image tokens concatenated into the text K/V, the scale on their values (one softmax)",
                           hint="Decoupled cross-attention keeps two softmaxes: the image tokens do not compete "
                                "with the text tokens for attention weight. Attend to each separately, then add "
                                "scale × the image attention's output.")
def _(attn, hidden_states, encoder_hidden_states, num_tokens, to_k_ip, to_v_ip, scale):
    return _ip(attn, hidden_states, encoder_hidden_states, num_tokens, to_k_ip, to_v_ip, scale, one_softmax=True,
               scaled_values=True)


@ip_adapter_attention.trap("scale applied to both terms",
                           hint="The scale weighs only the image term: out = Attn_text + scale·Attn_image. At "
                                "scale 0 the layer must be plain text cross-attention.")
def _(attn, hidden_states, encoder_hidden_states, num_tokens, to_k_ip, to_v_ip, scale):
    return _ip(attn, hidden_states, encoder_hidden_states, num_tokens, to_k_ip, to_v_ip, scale, scale_both=True)


@ip_adapter_attention.trap("image K/V through the text projections",
                           hint="The image tokens have their own trained projections, to_k_ip[i] / to_v_ip[i] "
                                "(the only new weights an IP-Adapter adds to each layer).")
def _(attn, hidden_states, encoder_hidden_states, num_tokens, to_k_ip, to_v_ip, scale):
    return _ip(attn, hidden_states, encoder_hidden_states, num_tokens, to_k_ip, to_v_ip, scale, text_proj=True)


@ip_adapter_attention.trap("every adapter reads the last n tokens (with two adapters, the first reads the second's)",
                           hint="The adapters' image tokens follow the text one adapter after another: adapter i's "
                                "are the num_tokens[i] after the text and the adapters before it. torch.split the "
                                "image part by num_tokens.")
def _(attn, hidden_states, encoder_hidden_states, num_tokens, to_k_ip, to_v_ip, scale):
    return _ip(attn, hidden_states, encoder_hidden_states, num_tokens, to_k_ip, to_v_ip, scale, last_n=True)


@ip_adapter_attention.trap("the scale used as a blend: (1 − s)·text + s·image",
                           hint="The text term keeps its full weight whatever the scale: out = Attn_text + "
                                "Σ scale_i·Attn_image_i. A blend would fade the prompt out as the image gets stronger.")
def _(attn, hidden_states, encoder_hidden_states, num_tokens, to_k_ip, to_v_ip, scale):
    return _ip(attn, hidden_states, encoder_hidden_states, num_tokens, to_k_ip, to_v_ip, scale, blend=True)


@ip_adapter_attention.trap("the adapters' token groups taken from the end (adapter 0 reads the last group)",
                           hint="The groups follow the text in the adapters' order: adapter 0's num_tokens[0] tokens "
                                "come first after the text. torch.split(image_part, num_tokens, dim=1).")
def _(attn, hidden_states, encoder_hidden_states, num_tokens, to_k_ip, to_v_ip, scale):
    return _ip(attn, hidden_states, encoder_hidden_states, num_tokens, to_k_ip, to_v_ip, scale, groups_from_end=True)


@ip_adapter_attention.trap("the heads never split (one attention over the full width)",
                           hint="Attention runs per head: view q, k, v as (B, tokens, heads, head_dim), move heads "
                                "before tokens, attend, and merge back; each head's softmax is scaled by "
                                "1/√head_dim.")
def _(attn, hidden_states, encoder_hidden_states, num_tokens, to_k_ip, to_v_ip, scale):
    return _ip(attn, hidden_states, encoder_hidden_states, num_tokens, to_k_ip, to_v_ip, scale, one_head=True)


@ip_adapter_attention.trap("image tokens taken from the front",
                           hint="The text tokens come first and the image tokens are appended at the end: split "
                                "at M − Σ num_tokens.")
def _(attn, hidden_states, encoder_hidden_states, num_tokens, to_k_ip, to_v_ip, scale):
    return _ip(attn, hidden_states, encoder_hidden_states, num_tokens, to_k_ip, to_v_ip, scale, split_front=True)
