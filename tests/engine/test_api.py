"""Input validation, stop conditions and lifecycle of the public Engine API."""
import threading

import pytest

from engine.errors import EngineClosedError
from tests.engine.conftest import VOCAB, make_engine, random_prompt, reference_greedy
from tieredkv import SamplingParams


@pytest.mark.parametrize("prompt,match", [
    ([], "empty"),
    ([VOCAB], "outside the vocabulary"),
    ([-1, 3], "outside the vocabulary"),
    (list(range(100)) * 6, "context"),
    (3.5, "string or a list"),
    ("text", "no tokenizer"),
])
def test_bad_prompts_are_value_errors(engine, prompt, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(prompt, SamplingParams(max_tokens=2))


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"seed": "x"}, "seed"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"logprobs": 99}, "logprobs"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_stop_token_ids_end_with_stop(engine):
    ids = random_prompt(9, seed=4)
    ref = reference_greedy(None, ids, 12)
    out = engine.generate(ids, SamplingParams(max_tokens=12, stop_token_ids=[ref[3]]))
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[:ref.index(ref[3]) + 1]


def test_generation_is_capped_by_context(tmp_path):
    with make_engine(tmp_path, device_memory=8 * 2048, host_memory=0) as eng:   # 8 pages = 32 tokens
        assert eng.max_context == 32
        out = eng.generate(random_prompt(28, seed=1), SamplingParams(max_tokens=50))
        assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_many_threads_get_the_same_greedy_outputs(engine):
    prompts = [random_prompt(7 + i, seed=i) for i in range(8)]
    expected = [engine.generate(p, SamplingParams(max_tokens=6)).token_ids for p in prompts]
    results = [None] * 16
    def run(i):
        results[i] = engine.generate(prompts[i % 8], SamplingParams(max_tokens=6)).token_ids
    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [expected[i % 8] for i in range(16)]


def test_closed_engine_refuses_requests(tmp_path):
    eng = make_engine(tmp_path)
    eng.close()
    eng.close()   # idempotent
    with pytest.raises(EngineClosedError):
        eng.generate([1, 2, 3])


def test_prefix_caching_off_reuses_no_block_and_bills_every_token_computed():
    # vLLM's --no-enable-prefix-caching (issue 31, item 5): the device pool shares nothing either.
    prompt, params = random_prompt(40, seed=3), SamplingParams(max_tokens=3)
    with make_engine(host_memory=0, disk=False) as on:          # the same engine with it on: an exact hit
        cached = [on.generate(prompt, params) for _ in range(2)]
    assert [o.usage.hit_tokens_by_tier["device"] for o in cached] == [0, 40]   # every token (issue 29)
    with make_engine(host_memory=0, disk=False, prefix_caching=False) as off:
        outs = [off.generate(prompt, params) for _ in range(2)]
        assert off.cache.cached_blocks()[0] == []                # no page kept findable
        assert off.lookup(prompt).hit_tokens == 0
    assert [(o.usage.prompt_cache_hit_tokens, o.usage.prompt_cache_miss_tokens) for o in outs] == [(0, 40), (0, 40)]
    assert [o.token_ids for o in outs] == [o.token_ids for o in cached]     # same tokens, all computed
    with pytest.raises(ValueError, match="prefix_caching=False.*host_memory"):
        make_engine(prefix_caching=False)                       # a host tier that could never be read


def test_ttft_and_usage_are_reported(engine):
    out = engine.generate(random_prompt(20, seed=2), SamplingParams(max_tokens=3))
    assert 0 < out.metrics.ttft_s <= out.metrics.total_s
    assert out.usage.total_tokens == 23


@pytest.fixture(scope="module")
def text_engine(tmp_path_factory, default_model):
    """A tiny random model that speaks through the real SmolLM2 tokenizer (fast, text-capable)."""
    from engine.model import model_from_config
    from tests.engine.conftest import tiny_llama_config
    from tieredkv import CacheConfig, Engine
    tok = default_model.tokenizer
    loaded = model_from_config(tiny_llama_config(vocab_size=len(tok)), tokenizer=tok, seed=0)
    eng = Engine(loaded, CacheConfig(block_size=4, device_memory="4MiB", host_memory="1MiB",
                                     disk_dir=str(tmp_path_factory.mktemp("kv") / "kv")))
    yield eng
    eng.close()


def test_stop_strings_truncate_text_and_are_never_streamed(text_engine):
    p = "Once upon a time there was"
    full = text_engine.generate(p, SamplingParams(max_tokens=20, ignore_eos=True))
    assert len(full.text) > 6
    stop = full.text[3:6]
    out = text_engine.generate(p, SamplingParams(max_tokens=20, stop=[stop], ignore_eos=True))
    assert out.finish_reason == "stop"
    assert out.text == full.text[:full.text.index(stop)]
    chunks = list(text_engine.stream(p, SamplingParams(max_tokens=20, stop=[stop], ignore_eos=True)))
    assert "".join(c.text for c in chunks) == out.text
    assert chunks[-1].finish_reason == "stop"


def test_streamed_text_concatenates_to_the_full_text(text_engine):
    p = "The weather today is"
    full = text_engine.generate(p, SamplingParams(max_tokens=16, ignore_eos=True))
    chunks = list(text_engine.stream(p, SamplingParams(max_tokens=16, ignore_eos=True)))
    assert "".join(c.text for c in chunks) == full.text
    assert sum((c.token_ids for c in chunks), []) == full.token_ids


def test_chat_template_and_bad_messages(text_engine):
    out = text_engine.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=3))
    assert out.usage.prompt_tokens == len(text_engine.apply_chat_template([{"role": "user", "content": "hello"}]))
    with pytest.raises(ValueError, match="messages"):
        text_engine.chat([{"role": "user"}])
    with pytest.raises(ValueError, match="messages"):
        text_engine.chat([])
