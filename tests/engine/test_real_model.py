"""End to end on the real default model (SmolLM2-135M-Instruct): answers, chat hits, restart from disk."""
import json
import subprocess
import sys
import textwrap

from engine.model import load_model
from tieredkv import CacheConfig, Engine, SamplingParams

PREFIX = ("You are a helpful geography assistant. Answer each question with a short, factual "
          "sentence and do not add anything else. Here is the question. ")
PROMPT = PREFIX + "The capital of France is"
PARAMS = SamplingParams(max_tokens=8)


# calibrate=False: the start's timing passes (7 forwards of the real model, ~5 s on 2 idle cores,
# twice here) are not what this test is about; without figures every hit loads, which is what
# the restart's disk hits below assert (tests/engine/test_calibration.py tests the calibration).
def _cache(tmp_path) -> CacheConfig:
    return CacheConfig(disk_dir=str(tmp_path / "kv"), device_memory="256MiB", host_memory="64MiB",
                       disk_capacity="1GiB", calibrate=False)


def test_paris_chat_hits_and_restart_from_disk(tmp_path, default_model):
    eng = Engine.from_loaded(default_model, _cache(tmp_path))
    try:
        short = eng.generate("The capital of France is", PARAMS)
        assert "Paris" in short.text
        first = eng.generate(PROMPT, PARAMS)
        assert "Paris" in first.text
        n = first.usage.prompt_tokens
        assert n > 32 and first.usage.prompt_cache_miss_tokens == n

        # Chat: turn 2 hits turn 1's prompt and answer.
        turn1 = [{"role": "user", "content": "Name three rivers of France, in one sentence."}]
        a1 = eng.chat(turn1, SamplingParams(max_tokens=20))
        turn2 = turn1 + [{"role": "assistant", "content": a1.text},
                         {"role": "user", "content": "Which of them is the longest?"}]
        a2 = eng.chat(turn2, SamplingParams(max_tokens=8))
        turn1_ids = eng.apply_chat_template(turn1)
        assert a2.usage.hit_tokens_by_tier["device"] >= (len(turn1_ids) // 16) * 16 > 0
        assert a2.usage.prompt_cache_hit_tokens + a2.usage.prompt_cache_miss_tokens == a2.usage.prompt_tokens
    finally:
        eng.close()   # flushes every cached block to disk

    # A new process on the same cache directory: the device pool and host slab start empty,
    # so the prefix comes from disk, and the greedy tokens are the same.
    # The same dtype as the session's model ("auto": bfloat16 on a CPU with native bf16).
    dtype = str(default_model.dtype).removeprefix("torch.")
    code = textwrap.dedent(f"""
        import json
        from tieredkv import CacheConfig, Engine, SamplingParams
        eng = Engine.from_pretrained(None, CacheConfig(disk_dir={str(tmp_path / 'kv')!r}, device_memory="256MiB",
                                     host_memory="64MiB", disk_capacity="1GiB", calibrate=False),
                                     device="cpu", dtype={dtype!r})
        out = eng.generate({PROMPT!r}, SamplingParams(max_tokens=8))
        bill = eng.ledger.tenant("default")
        eng.close()
        print(json.dumps({{"tokens": out.token_ids, "hits": out.usage.hit_tokens_by_tier,
                          "miss": out.usage.prompt_cache_miss_tokens, "requests": bill.requests}}))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["tokens"] == first.token_ids
    # An exact repeat: every prompt token (its tail and its logits kept too) read from disk.
    assert got["hits"] == {"device": 0, "host": 0, "disk": n, "remote": 0}
    assert got["miss"] == 0
    assert got["requests"] == 5     # the ledger survived the restart: 4 earlier requests + this one
