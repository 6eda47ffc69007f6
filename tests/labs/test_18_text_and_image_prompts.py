"""Lab 18: wrong-but-plausible implementations fail, and the commonest ones are named."""
from expect import Fails

LAB = "18_text_and_image_prompts"


def embeds_body(pick="text_encoder.final_layer_norm(out.hidden_states[-(clip_skip + 1)])",
                plain="out.last_hidden_state") -> str:
    """A body for prompt_embeds with one line swapped for a wrong one."""
    return f"""
    out = text_encoder(input_ids, output_hidden_states=True)
    if clip_skip is None:
        return {plain}
    return {pick}
    """


def pooled_body(legacy="input_ids.argmax(-1)", current="(input_ids == eos_token_id).int().argmax(-1)") -> str:
    """A body for pooled_embedding with one line swapped for a wrong one."""
    return f"""
    position = {legacy} if eos_token_id == 2 else {current}
    return last_hidden_state[torch.arange(last_hidden_state.shape[0]), position]
    """


def cfg_body(neg_skip="None", neg_rep=".repeat_interleave(n, 0)", pos_rep=".repeat_interleave(n, 0)",
             out="torch.cat([negative, positive])") -> str:
    """A body for cfg_text_batch with one line swapped for a wrong one."""
    return f"""
    n = num_images_per_prompt
    positive = prompt_embeds(text_encoder, input_ids, clip_skip){pos_rep}
    negative = prompt_embeds(text_encoder, negative_input_ids, {neg_skip}){neg_rep}
    return {out}
    """


def ip_body(text_kv="attn.to_k(text), attn.to_v(text)", ip_kv="to_k(image), to_v(image)",
            add="out = out + s * merge_heads(ip)", split="text_len", end="attn.to_out[1](attn.to_out[0](out))") -> str:
    """A body for ip_adapter_attention with one line swapped for a wrong one."""
    return f"""
    heads = attn.heads
    text_len = encoder_hidden_states.shape[1] - sum(num_tokens)
    text = encoder_hidden_states[:, :{split}]
    images = torch.split(encoder_hidden_states[:, text_len:], list(num_tokens), dim=1)
    q = split_heads(attn.to_q(hidden_states), heads)
    k, v = {text_kv}
    out = merge_heads(F.scaled_dot_product_attention(q, split_heads(k, heads), split_heads(v, heads)))
    for image, to_k, to_v, s in zip(images, to_k_ip, to_v_ip, scale):
        k, v = {ip_kv}
        ip = F.scaled_dot_product_attention(q, split_heads(k, heads), split_heads(v, heads))
        {add}
    return {end}
    """


ONE_SOFTMAX = """
    heads = attn.heads
    text_len = encoder_hidden_states.shape[1] - sum(num_tokens)
    text = encoder_hidden_states[:, :text_len]
    images = torch.split(encoder_hidden_states[:, text_len:], list(num_tokens), dim=1)
    q = split_heads(attn.to_q(hidden_states), heads)
    k = torch.cat([attn.to_k(text)] + [f(i) for i, f in zip(images, to_k_ip)], 1)
    v = torch.cat([attn.to_v(text)] + [f(i) for i, f in zip(images, to_v_ip)], 1)
    out = merge_heads(F.scaled_dot_product_attention(q, split_heads(k, heads), split_heads(v, heads)))
    return attn.to_out[0](out)
    """

MUTANTS = [
    # (function, wrong body, the trap the message must name, or Fails(reason, text) when no trap fits)
    ("prompt_embeds", embeds_body(pick="out.last_hidden_state"), "last hidden state used although clip_skip is set"),
    ("prompt_embeds", embeds_body(pick="out.hidden_states[-(clip_skip + 1)]"),
     "final layer norm skipped after clip_skip"),
    ("prompt_embeds", embeds_body(pick="text_encoder.final_layer_norm(out.hidden_states[-clip_skip])"),
     "hidden_states[-clip_skip] (one layer too late)"),
    ("prompt_embeds", embeds_body(plain="out.hidden_states[-1]"), Fails("wrong", "values differ")),
    ("prompt_embeds", embeds_body(plain="text_encoder.final_layer_norm(out.last_hidden_state)"),
     "final layer norm applied to last_hidden_state too"),
    ("pooled_embedding", "    return last_hidden_state[:, -1]\n", "pooled from the last position"),
    ("pooled_embedding", "    return last_hidden_state[:, 0]\n", "pooled from the first token (BOS)"),
    ("pooled_embedding", pooled_body(current="input_ids.argmax(-1)"), "argmax of the ids whatever the config"),
    ("pooled_embedding", pooled_body(legacy="(input_ids == eos_token_id).int().argmax(-1)"),
     "ids == eos_token_id under the legacy config (eos_token_id 2)"),
    ("pooled_embedding", "    return last_hidden_state.mean(1)\n", Fails("wrong", "values differ")),
    ("cfg_text_batch", cfg_body(out="torch.cat([positive, negative])"), "CFG batch ordered [positive, negative]"),
    ("cfg_text_batch", cfg_body(neg_rep=""), "negative embeds not repeated per image"),
    ("cfg_text_batch", cfg_body(neg_rep=".repeat(n, 1, 1)", pos_rep=".repeat(n, 1, 1)"),
     "the batch tiled (p0, p1, p0, p1) instead of per prompt"),
    ("cfg_text_batch", cfg_body(neg_skip="clip_skip"), "clip_skip applied to the negative prompt too"),
    ("cfg_text_batch", cfg_body(out="positive"), Fails("wrong", "shape")),
    ("ip_adapter_attention", ONE_SOFTMAX, "image tokens concatenated into the text K/V (one softmax)"),
    ("ip_adapter_attention",  # a blind learner's: each adapter's tokens taken from the end
     ip_body().replace("images = torch.split(encoder_hidden_states[:, text_len:], list(num_tokens), dim=1)",
                       "images = [encoder_hidden_states[:, -n:] for n in num_tokens]"),
     "every adapter reads the last n tokens"),
    ("ip_adapter_attention", ip_body(add="out = s * out + s * merge_heads(ip)"), "scale applied to both terms"),
    ("ip_adapter_attention", ip_body(ip_kv="attn.to_k(image), attn.to_v(image)"),
     "image K/V through the text projections"),
    ("ip_adapter_attention",  # a blind learner's: one softmax, each adapter's values times its scale
     ONE_SOFTMAX.replace("[f(i) for i, f in zip(images, to_v_ip)]", "[f(i) * s for i, f, s in zip(images, to_v_ip, scale)]"),
     "image tokens concatenated into the text K/V, the scale on their values"),
    ("ip_adapter_attention", ip_body(add="out = (1 - s) * out + s * merge_heads(ip)"),
     "the scale used as a blend"),
    ("ip_adapter_attention",  # a blind learner's: the groups peeled off the end in list order
     ip_body().replace("images = torch.split(encoder_hidden_states[:, text_len:], list(num_tokens), dim=1)",
                       "images = torch.split(encoder_hidden_states[:, text_len:], list(num_tokens)[::-1], dim=1)"
                       "[::-1]"),
     "the adapters' token groups taken from the end"),
    ("ip_adapter_attention", ip_body().replace("heads = attn.heads", "heads = 1"),
     "the heads never split"),
    ("ip_adapter_attention", ip_body(add="out = out + merge_heads(ip)"), Fails("wrong", "values differ")),
    ("ip_adapter_attention", ip_body(end="attn.to_out[0](out) + hidden_states"), Fails("wrong", "values differ")),
]

ALTERNATIVES = [
    # (function, right body written another way, why it is right)
    ("prompt_embeds", """
    out = text_encoder(input_ids, output_hidden_states=True)
    k = 0 if clip_skip is None else clip_skip
    h = out.hidden_states[len(out.hidden_states) - 1 - k]
    return F.layer_norm(h, h.shape[-1:], text_encoder.final_layer_norm.weight,
                        text_encoder.final_layer_norm.bias, text_encoder.final_layer_norm.eps)
    """, "one path for every clip_skip: final_layer_norm(hidden_states[-1]) is last_hidden_state"),
    ("pooled_embedding", """
    rows = []
    for b in range(input_ids.shape[0]):
        ids = input_ids[b].tolist()
        pos = ids.index(max(ids)) if eos_token_id == 2 else ids.index(eos_token_id)
        rows.append(last_hidden_state[b, pos])
    return torch.stack(rows)
    """, "a Python loop: list.index finds the first EOS, as argmax of a 0/1 mask does"),
    ("cfg_text_batch", cfg_body(neg_rep=".unsqueeze(1).expand(-1, n, -1, -1).flatten(0, 1)"),
     "repeat per prompt by expand + flatten: the same rows"),
    ("ip_adapter_attention", """
    heads = attn.heads
    text_len = encoder_hidden_states.shape[1] - sum(num_tokens)
    text, x = encoder_hidden_states[:, :text_len].double(), hidden_states.double()
    images = torch.split(encoder_hidden_states[:, text_len:].double(), list(num_tokens), dim=1)
    lin = lambda layer, t: F.linear(t, layer.weight.double(), None if layer.bias is None else layer.bias.double())
    def attend(q, k, v):
        q, k, v = (split_heads(t, heads) for t in (q, k, v))
        w = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1)
        return merge_heads(w @ v)
    q = lin(attn.to_q, x)
    out = attend(q, lin(attn.to_k, text), lin(attn.to_v, text))
    for image, to_k, to_v, s in zip(images, to_k_ip, to_v_ip, scale):
        out = out + s * attend(q, lin(to_k, image), lin(to_v, image))
    return lin(attn.to_out[0], out).to(hidden_states.dtype)
    """, "softmax written out, in float64, cast once (closer to exact math than diffusers in float16)"),
]


def test_calling_the_ip_adapter_processor_is_refused(grade_mutant):
    graded = grade_mutant(LAB, "ip_adapter_attention", """
        return attn(hidden_states, encoder_hidden_states)
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text


def test_the_negative_prompt_ignores_clip_skip_in_diffusers_as_the_lesson_says():
    # The lesson's claim, on diffusers itself: the negative branch of encode_prompt is the same with and
    # without clip_skip (only the positive branch reads hidden_states).
    import importlib.util
    from pathlib import Path

    import torch

    path = Path(__file__).resolve().parents[2] / "graders" / f"{LAB}.py"
    spec = importlib.util.spec_from_file_location("grader18", path)
    grader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grader)
    g = torch.Generator().manual_seed(0)
    pipe = grader.text_pipeline(grader.text_encoder(g))
    with torch.no_grad():
        pos0, neg0 = pipe.encode_prompt(["a red fox"], torch.device("cpu"), 1, True, clip_skip=None)
        pos1, neg1 = pipe.encode_prompt(["a red fox"], torch.device("cpu"), 1, True, clip_skip=1)
    assert torch.equal(neg0, neg1) and not torch.allclose(pos0, pos1)
