"""A second server in its own process, for tests/engine/test_remote_engine.py: an engine on the tiny
random-weight model with its own disk directory and the given remote store. Generates the prompts
(greedy), closes (the final flush sends its blocks to the store) and prints one JSON line with
each output's tokens and usage, and the remote tier's status."""
import json
import sys

from storage.config import CacheConfig
from tests.engine.conftest import tiny_llama_config
from engine.model import model_from_config
from tieredkv import Engine, SamplingParams


def main() -> None:
    args = json.loads(sys.argv[1])
    cache = CacheConfig(block_size=4, device_memory="256KiB", host_memory="256KiB", disk_dir=args["disk_dir"],
                        disk_capacity="64MiB", remote_url=args["url"], remote_write=args.get("remote_write", "write_back"))
    eng = Engine(model_from_config(tiny_llama_config(), seed=0), cache, exact_hits=False)
    try:
        outs = eng.generate(args["prompts"], SamplingParams(max_tokens=args["max_tokens"]), tenant=args["tenant"])
    finally:
        eng.close()
    remote = eng.cache.stats()["remote"].to_dict()
    print(json.dumps({"outputs": [{"tokens": o.token_ids, "hits": o.usage.hit_tokens_by_tier,
                                   "miss": o.usage.prompt_cache_miss_tokens} for o in outs],
                      "remote": remote}))


if __name__ == "__main__":
    main()
