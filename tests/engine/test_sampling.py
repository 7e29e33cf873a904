"""Issue 17, item 4: the sampling fields vLLM users rely on -- penalties, min_p, min_tokens,
stop_token_ids, include_stop_str_in_output -- each checked against a reference computed
independently (transformers' generate, or a plain loop over full forwards), and batched."""
from __future__ import annotations

import pytest
import torch

from engine.model import model_from_config
from engine.sampler import _processed, make_generator, sample_batch
from tests.engine.conftest import VOCAB, make_engine, random_prompt, reference_greedy, tiny_llama_config
from tieredkv import SamplingParams

PROMPT = random_prompt(9, seed=4)
N = 16


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    e = make_engine(tmp_path_factory.mktemp("sampling"))
    yield e
    e.close()


@pytest.fixture(scope="module")
def hf_model():
    return model_from_config(tiny_llama_config(), seed=0).model


def reference(model, ids: list[int], n: int, process) -> list[int]:
    """Greedy over full forwards (no KV cache at all), `process(logits, output so far)` applied
    to each step's float32 logits before the argmax."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids + out])).logits[0, -1].float().clone()
            out.append(int(process(logits, out).argmax()))
    return out


def openai_penalties(freq: float, pres: float):
    def process(logits, out):
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=VOCAB).float() if out else \
            torch.zeros(VOCAB)
        return logits - freq * counts - pres * (counts > 0).float()
    return process


def test_the_tiny_model_repeats_itself_so_penalties_have_something_to_change():
    plain = reference_greedy(None, PROMPT, N)
    assert len(set(plain)) < len(plain), plain


def test_repetition_penalty_equals_transformers(eng):
    plain = eng.generate(PROMPT, SamplingParams(max_tokens=N)).token_ids
    for penalty in (1.3, 0.7):
        model = model_from_config(tiny_llama_config(), seed=0).model
        with torch.no_grad():
            want = model.generate(torch.tensor([PROMPT]), max_new_tokens=N, do_sample=False, eos_token_id=None,
                                  pad_token_id=0, repetition_penalty=penalty)[0, len(PROMPT):].tolist()
        got = eng.generate(PROMPT, SamplingParams(max_tokens=N, repetition_penalty=penalty)).token_ids
        assert got == want, penalty
        assert got != plain, penalty


@pytest.mark.parametrize("freq,pres", [(1.5, 0.0), (0.0, 2.0), (0.5, 0.5), (-1.0, 0.0)])
def test_frequency_and_presence_penalties_are_openais(eng, hf_model, freq, pres):
    got = eng.generate(PROMPT, SamplingParams(max_tokens=N, frequency_penalty=freq, presence_penalty=pres)).token_ids
    assert got == reference(hf_model, PROMPT, N, openai_penalties(freq, pres))
    plain = eng.generate(PROMPT, SamplingParams(max_tokens=N)).token_ids
    assert got != plain
    if freq >= 0 and pres >= 0:
        assert len(set(got)) > len(set(plain))      # penalized repetition: more distinct tokens


def test_min_tokens_holds_back_stop_token_ids(eng, hf_model):
    plain = eng.generate(PROMPT, SamplingParams(max_tokens=N)).token_ids
    stop = plain[2]
    first = plain.index(stop)
    out = eng.generate(PROMPT, SamplingParams(max_tokens=N, stop_token_ids=[stop]))
    assert out.finish_reason == "stop" and out.token_ids == plain[:first + 1]

    def ban(logits, produced):
        if len(produced) < 8:
            logits[stop] = float("-inf")
        return logits
    want = reference(hf_model, PROMPT, N, ban)
    out = eng.generate(PROMPT, SamplingParams(max_tokens=N, stop_token_ids=[stop], min_tokens=8))
    assert stop not in out.token_ids[:8] and len(out.token_ids) > first + 1
    if stop in want[8:]:
        assert out.finish_reason == "stop" and out.token_ids == want[:want.index(stop, 8) + 1]
    else:
        assert out.finish_reason == "length" and out.token_ids == want


def test_min_tokens_holds_back_eos_unless_ignore_eos(tmp_path):
    plain = reference_greedy(None, PROMPT, N)
    eos = plain[1]
    with make_engine(tmp_path, tiny_llama_config(eos_token_id=eos)) as e:
        assert e.generate(PROMPT, SamplingParams(max_tokens=N)).token_ids == plain[:plain.index(eos) + 1]
        out = e.generate(PROMPT, SamplingParams(max_tokens=N, min_tokens=5))
        assert len(out.token_ids) >= 5 and eos not in out.token_ids[:5]
        assert out.finish_reason == "length" or out.token_ids[-1] == eos
        # ignore_eos: the end token is no stop, so min_tokens does not hold it back.
        assert e.generate(PROMPT, SamplingParams(max_tokens=N, min_tokens=5, ignore_eos=True)).token_ids == plain


def test_min_p_1_samples_the_greedy_tokens(eng):
    greedy = eng.generate(PROMPT, SamplingParams(max_tokens=N)).token_ids
    for seed in range(3):
        got = eng.generate(PROMPT, SamplingParams(max_tokens=N, temperature=1.5, min_p=1.0, seed=seed)).token_ids
        assert got == greedy
    # Without min_p, the same temperature does wander off the greedy path on this random model.
    assert any(eng.generate(PROMPT, SamplingParams(max_tokens=N, temperature=1.5, seed=s)).token_ids != greedy
               for s in range(3))


def test_min_p_keeps_only_tokens_near_the_top():
    logits = torch.tensor([[4.0, 3.9, 1.0, 0.0, -2.0]])
    p = SamplingParams(temperature=1.0, min_p=0.5, seed=0)
    g = make_generator(p)
    drawn = {sample_batch(logits, [p], [g]).read()[0].token for _ in range(200)}
    assert drawn == {0, 1}          # exp(3.9 - 4) = 0.90 >= 0.5; exp(1 - 4) = 0.05 < 0.5


def test_penalties_are_batched_and_leave_other_rows_bit_identical():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=g)
    history = [([1, 2, 3], [5, 5, 7]), ([9], [1]), ([4, 4], [4, 8]), ([3], [])]
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3),
              SamplingParams(), SamplingParams(presence_penalty=-0.5, min_tokens=3, stop_token_ids=[2])]
    scores = _processed(logits, params, history, eos_ids={6})
    assert torch.equal(scores[0], logits[0]) and torch.equal(scores[2], logits[2])
    # Row 1, by hand: prompt+output seen {9, 1}; output counts {1: 1}.
    want = logits[1].clone()
    for t in (9, 1):
        want[t] = want[t] / 1.5 if want[t] > 0 else want[t] * 1.5
    want[1] -= 0.3
    assert torch.allclose(scores[1], want)
    # Row 3: no output yet (presence has nothing to add); min_tokens bans its stop id and the eos.
    assert scores[3, 2] == float("-inf") and scores[3, 6] == float("-inf")
    assert torch.equal(scores[3, 7:], logits[3, 7:])
    tokens = [r.token for r in sample_batch(logits, params, [None] * 4, history, {6}).read()]
    assert tokens == [int(scores[i].argmax()) for i in range(4)]


def test_a_step_without_penalties_pays_nothing():
    logits = torch.randn(3, VOCAB)
    params = [SamplingParams(), SamplingParams(temperature=0.5, top_k=5), SamplingParams(min_tokens=2, max_tokens=4)]
    assert _processed(logits, params, [([1], [2, 3])] * 3, eos_ids={0}) is logits     # min_tokens reached
    assert _processed(logits, params[:2], None, eos_ids={0}) is logits


def test_stop_token_ids_outside_the_vocabulary_are_refused(eng):
    with pytest.raises(ValueError, match="stop_token_ids"):
        eng.generate(PROMPT, SamplingParams(max_tokens=2, stop_token_ids=[VOCAB]))


@pytest.mark.parametrize("kwargs,field", [
    ({"min_p": -0.1}, "min_p"), ({"min_p": 1.5}, "min_p"), ({"min_p": float("nan")}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 17}, "min_tokens"), ({"min_tokens": 1.0}, "min_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"presence_penalty": -3}, "presence_penalty"),
    ({"presence_penalty": True}, "presence_penalty"), ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"stop_token_ids": 5}, "stop_token_ids"), ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_bad_new_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_default_params_are_unpenalized():
    p = SamplingParams()
    assert not p.penalized and p.min_tokens == 0 and p.min_p == 0 and not p.include_stop_str_in_output


def test_the_engine_seed_seeds_a_stream_of_requests_as_vllms_does() -> None:
    """Issue 40: Engine(seed=N) (`serve --seed N`) seeds the engine once, as vLLM's --seed: repeated
    unseeded sampled requests differ, the same requests in the same order sample the same on an
    engine seeded alike, and a request's own seed still decides its own draw."""
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)

    def run(seed: int | None) -> list[list[int]]:
        with make_engine(seed=seed) as e:
            return [e.generate(PROMPT, params).token_ids for _ in range(3)] + \
                [e.generate(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, seed=5)).token_ids]

    first, again, other = run(7), run(7), run(8)
    assert len({tuple(t) for t in first[:3]}) == 3, first     # each unseeded request draws anew
    assert again == first                                     # the same stream from the same seed
    assert other[:3] != first[:3]
    assert first[3] == other[3]                               # seed=5 is the request's, whatever the engine's
    with pytest.raises(ValueError, match="seed"):
        make_engine(seed=-1)
