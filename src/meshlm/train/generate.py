"""Sampling text from a trained model: temperature, top-k and top-p (nucleus), one token at a time,
optionally stopping at the end-of-text token.

No KV cache: each new token re-runs the (short) context. That keeps the model free of
inference-only state; for the model sizes trained here it costs milliseconds.
"""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float = 1.0) -> torch.Tensor:
    """`logits` [V] with every token outside the top-k, then outside the nucleus, set to -inf.

    The nucleus (Holtzman et al.; Hugging Face's and Megatron's `top_p`) is the smallest set of the
    most probable tokens whose probabilities sum to at least `top_p`: a token stays if the tokens
    ranked above it sum to less than `top_p`, so the most probable one always stays."""
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        drop = probs.cumsum(-1) - probs >= top_p
        drop[0] = False
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def start_ids(tokenizer, prompt: str, end_id: int | None = None) -> list[int]:
    """The prompt's ids, encoded as the training data was: no special tokens added (a Llama
    tokenizer's post-processor would put a BOS in front that meshlm never trains with). An empty
    prompt starts where a document does, after the end-of-text token the corpus separated
    documents with: `end_id` (the run's, `tokenizer.run_end_token`), else the first known name the
    tokenizer has (id 0 in meshlm's BPE, not in a pretrained tokenizer's)."""
    from meshlm.train.tokenizer import encode, known_end_token

    if end_id is None:
        end_id = known_end_token(tokenizer)[1]
    return encode(tokenizer, prompt) or [0 if end_id is None else end_id]


@torch.no_grad()
def sample(model, tokenizer, prompt: str, max_new_tokens: int = 100, temperature: float = 0.8,
           top_k: int | None = 40, seed: int = 0, max_context: int | None = None,
           end_id: int | None = None, top_p: float = 1.0, stop_at_end: bool = False) -> str:
    """Continue `prompt`; returns prompt + generated text. `end_id`: the run's end-of-text token
    (see `start_ids`); with `stop_at_end`, generation stops once it is drawn (the document is
    over), else it goes on into a new document, the token itself invisible in the text."""
    if temperature < 0:
        raise ValueError("temperature must be >= 0 (0 = greedy)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError("top_p must be in (0, 1] (1 = off)")
    from meshlm.train.tokenizer import known_end_token

    if end_id is None:
        end_id = known_end_token(tokenizer)[1]
    device = next(model.parameters()).device
    # A model.vocab_size padded past the tokenizer (to a multiple of 64 or 128, as Megatron pads)
    # has rows no text maps to: never targets in training, yet they keep some probability (~3% in
    # all after 30 steps of a small run). Drawn, one would print nothing and feed the model an
    # embedding it never trained on; they are excluded, as Megatron's sampler does.
    n_ids = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    ids = start_ids(tokenizer, prompt, end_id)
    tokens = torch.tensor([ids], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    max_context = max_context or model.cfg.max_seq_len
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -max_context:])[0, -1].float()
        logits[n_ids:] = float("-inf")
        if temperature == 0:
            next_id = logits.argmax()
        else:
            logits = (logits - logits.max()) / temperature  # a tiny temperature tends to greedy, never to inf - inf
            logits = filter_logits(logits, top_k, top_p)
            next_id = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[0]
        tokens = torch.cat([tokens, next_id.view(1, 1)], dim=1)
        if stop_at_end and end_id is not None and int(next_id) == end_id:
            break
    return tokenizer.decode(tokens[0].tolist())
