"""Paged attention's grouping of prefill chunks: which chunks share one SDPA call, and that a
shared call gives each sequence exactly the logits it gets alone (tiny fp32 model, real pool)."""
from __future__ import annotations

import torch

from engine.model import kv_layout, model_from_config
from engine.attention_backends import GATHER_SDPA
from engine.paged_attention import ATTN_NAME, register
from engine.paged_batch import PagedBatch, SeqSlice, prefill_groups
from tests.engine.conftest import random_prompt, tiny_llama_config

BS = 4


def slices(specs: list[tuple[int, int]]) -> list[SeqSlice]:
    out, q, page = [], 0, 0
    for q_len, ctx in specs:
        n = -(-ctx // BS)
        out.append(SeqSlice(q, q_len, ctx, tuple(range(page, page + n))))
        page, q = page + n, q + q_len
    return out


def test_short_prefills_share_a_group_and_a_long_one_stays_alone() -> None:
    s = slices([(8, 8), (6, 6), (300, 300), (8, 10), (7, 7)])
    groups = prefill_groups(s)
    assert [[x.q_len for x in g] for g in groups] == [[6, 7, 8, 8], [300]]
    assert prefill_groups([]) == []


def test_a_shared_group_gives_each_sequence_its_own_logits() -> None:
    register()
    loaded = model_from_config(tiny_llama_config(), seed=0)
    loaded.model.set_attn_implementation(ATTN_NAME)
    layout = kv_layout(loaded, BS)
    prompts = [random_prompt(n, seed=n) for n in (9, 5, 12)]

    def last_logits(batch_prompts: list[list[int]]) -> list[torch.Tensor]:
        kv = torch.zeros((32, *layout.shape), dtype=layout.dtype)
        sl = slices([(len(p), len(p)) for p in batch_prompts])
        batch = PagedBatch(kv, sl, BS, GATHER_SDPA)
        ids = [t for p in batch_prompts for t in p]
        pos = [i for p in batch_prompts for i in range(len(p))]
        last = torch.tensor([x.q_start + x.q_len - 1 for x in sl])
        with torch.inference_mode():
            out = loaded.model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]), use_cache=False,
                               logits_to_keep=last, tkv_batch=batch)
        return list(out.logits[0])

    together = last_logits(prompts)
    assert len(PagedBatch(torch.zeros((32, *layout.shape)), slices([(9, 9), (5, 5), (12, 12)]), BS, GATHER_SDPA).groups) == 1
    for p, got in zip(prompts, together):
        alone = last_logits([p])[0]
        assert torch.allclose(got, alone, atol=1e-5), (got - alone).abs().max()
