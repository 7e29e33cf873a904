"""`tieredkv serve` with the flags vLLM and llama-server users type (tieredkv/cli_flags.py):
taken with their meanings, or refused with a message naming what to use instead."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.test_cli import ENV, REPO, Lines, assert_one_line_error, tkv
from tieredkv.cli_flags import ALIASES, FLAG_TABLE, REFUSED, translate


def test_aliases_are_rewritten_and_only_on_serve() -> None:
    assert translate(["serve", "-np", "4", "--ubatch-size=128"]) == ["serve", "--max-num-seqs", "4",
                                                                   "--max-num-batched-tokens=128"]
    assert translate(["status", "-np"]) == ["status", "-np"]
    assert set(ALIASES.values()) <= {"--max-num-seqs", "--max-num-batched-tokens"}


def test_flags_serve_cannot_honour_are_refused_naming_what_to_use(tmp_path: Path) -> None:
    root = str(tmp_path / "srv")
    assert_one_line_error(tkv("serve", "--tensor-parallel-size", "2", "--cache-dir", root), 2,
                          "--tensor-parallel-size", "tieredkv route")
    assert_one_line_error(tkv("serve", "-ngl", "99", "--cache-dir", root), 2, "-ngl", "--device")
    assert_one_line_error(tkv("serve", "--swap-space=4", "--cache-dir", root), 2, "--swap-space", "--host-memory")
    assert_one_line_error(tkv("serve", "--gpu-memory-utilization", "0.9", "--device", "cpu", "--cache-dir", root), 2,
                          "--gpu-memory-utilization", "CPU", "--device-memory")
    assert_one_line_error(tkv("serve", "--gpu-memory-utilization", "1.5", "--device", "cpu", "--cache-dir", root), 2,
                          "--gpu-memory-utilization", "(0, 1]")
    assert_one_line_error(tkv("serve", "--chat-template", str(tmp_path / "none.jinja"), "--cache-dir", root), 2,
                          "--chat-template", "no such file")
    assert_one_line_error(tkv("serve", "--api-key", " ", "--cache-dir", root), 2, "--api-key", "non-empty")
    assert_one_line_error(tkv("serve", "--no-enable-prefix-caching", "--cache-dir", root,
                              TIEREDKV_REMOTE_URL="valkey://127.0.0.1:1"), 2, "--no-enable-prefix-caching",
                          "TIEREDKV_REMOTE_URL")
    assert not Path(root).exists()
    for flag, why in REFUSED.items():          # every refusal says what to do instead
        assert len(why) > 10 and flag.startswith("-"), flag


def test_serve_with_vllm_and_llama_server_flags(tmp_path: Path, tiny_model_dir: Path) -> None:
    root = tmp_path / "srv"
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    keys = ["sk-test", "x"]          # any non-empty key, as vLLM takes it
    proc = subprocess.Popen([sys.executable, "-m", "tieredkv.cli", "serve", "-m", str(tiny_model_dir), "-c", "256",
                             "--port", "0", "--cache-dir", str(root), "--dtype", "float32", "--device-memory", "8MiB",
                             "--api-key", keys[0], "--api-key", keys[1], "--seed", "7", "-np", "4",
                             "--max-num-batched-tokens", "128", "-t", "1", "--no-enable-prefix-caching",
                             "--disable-log-requests", "--chat-template", str(template), "--log-level", "debug"],
                            cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines = Lines(proc.stderr)
        # To a pipe, the load is a plain line before and one after (never a silence).
        lines.wait(r"^tieredkv: Loading .* \.\.\.$", proc, 180)
        lines.wait(r"^tieredkv: Loading .*: done in \d+\.\d s$", proc, 180)
        url = lines.wait(r"serving \S+ on (http://127\.0\.0\.1:\d+)", proc, 180)[1]
        lines.wait(r"Uvicorn running|Application startup complete", proc, 60)
        text = "".join(lines.lines)
        # The start-up heap is frozen before the first request (tieredkv/startup_heap.py): torch,
        # transformers and the model alone are tens of thousands of tracked objects (a DEBUG line).
        frozen = lines.wait(r"tieredkv.service: ([\d,]+) start-up objects frozen", proc, 30)[1]
        assert int(frozen.replace(",", "")) > 10_000
        assert re.search(r"host tier\s+off", text) and re.search(r"disk tier\s+off", text), text
        assert "--no-enable-prefix-caching: no request reuses another's blocks" in text
        assert httpx.get(f"{url}/v1/models").status_code == 401
        for key in keys:
            models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert models.status_code == 200 and models.json()["data"][0]["max_model_len"] == 256
        auth = {"Authorization": f"Bearer {keys[0]}"}
        body = {"model": models.json()["data"][0]["id"], "prompt": "Seeds make sampling repeatable. " * 6,
                "max_tokens": 8, "temperature": 1.0}
        answers = [httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=60).json() for _ in range(2)]
        texts = {a["choices"][0]["text"] for a in answers}
        assert len(texts) == 2            # --seed seeds the engine once (vLLM's): unseeded requests differ
        # --no-enable-prefix-caching: the repeated prompt (several full blocks of 16) hits nothing,
        # not even the device pool that computed it a moment ago; every token is billed computed.
        usage = [a["usage"] for a in answers]
        assert usage[0]["prompt_tokens"] > 2 * 16 and usage[1]["prompt_tokens"] == usage[0]["prompt_tokens"]
        assert [(u["prompt_cache_hit_tokens"], u["prompt_cache_miss_tokens"]) for u in usage] == [
            (0, usage[0]["prompt_tokens"])] * 2
        seeded = [httpx.post(f"{url}/v1/completions", json={**body, "seed": 7}, headers=auth, timeout=60).json()
                  for _ in range(2)]
        assert seeded[0]["choices"][0]["text"] == seeded[1]["choices"][0]["text"]     # a request's own seed
        # --chat-template: the messages' contents, one a line, are the prompt.
        chat = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "Hello"}]}, headers=auth)
        plain = httpx.post(f"{url}/tokenize", json={"prompt": "Hello\n"}, headers=auth)
        assert chat.json()["tokens"] == plain.json()["tokens"], (chat.text, plain.text)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    assert "tieredkv.requests:" not in "".join(lines.lines)      # --disable-log-requests


def test_status_disk_line_never_says_bounded_above_the_capacity() -> None:
    from storage.disk.health import space_line
    from tieredkv.cli import drawn

    def disk_space_line(disk: dict) -> str | None:
        row = space_line(disk)
        return None if row is None else drawn(row)
    gib = 1 << 30
    roomy = disk_space_line({"space_bound_bytes": 69 * gib, "capacity_bytes": 50 * gib, "used_bytes": gib,
                             "free_bytes": 70 * gib})
    assert roomy == "disk: 1.0GiB used of its 50.0GiB capacity (70.0GiB free on its filesystem: room for all of it)"
    tight = disk_space_line({"space_bound_bytes": 3 * gib, "capacity_bytes": 50 * gib, "used_bytes": gib,
                             "free_bytes": 4 * gib})
    assert "bounded by free space" in tight and "the capacity is 50.0GiB but 4.0GiB free holds the store file at " \
        "3.0GiB" in tight
    assert disk_space_line({"capacity_bytes": 50 * gib}) is None


def test_the_flag_table_says_refused_exactly_for_the_refused_flags() -> None:
    for flags, _source, meaning in FLAG_TABLE:
        names = [f.split()[0] for f in flags.split(", ")]
        refused = [n for n in names if n in REFUSED]
        assert (meaning.startswith("refused:") == bool(refused)), flags
        if refused:
            assert refused == names, flags       # a row is all refused or all taken


def test_serve_takes_its_cache_defaults_from_cache_configs_fields() -> None:
    """CacheConfig's dataclass fields are the one place a cache default is written (issue 32): the
    serve options named after a field default to it, the ones left None say it in their help, and
    a changed field default reaches the option (checked in a child that changes one first)."""
    import dataclasses
    import inspect

    from storage.config import CacheConfig
    from tieredkv import cli_serve
    from tieredkv.cli_flags import pool_size
    fields = {f.name: f.default for f in dataclasses.fields(CacheConfig)}
    opts = {n: p.default for n, p in inspect.signature(cli_serve.serve).parameters.items()}
    taken = {n: o.default for n, o in opts.items() if n in fields and o.default is not None}
    assert set(taken) == {"host_memory", "disk_capacity", "disk_reserve", "codec", "block_size", "restore_policy",
                          "kv_events_tokens", "seal_disk"}
    assert taken == {n: fields[n] for n in taken}
    for opt, field in (("device_memory", "device_memory"), ("remote_timeout", "remote_timeout_s")):
        assert f"(default {fields[field]})" in opts[opt].help
    assert pool_size(None, None, "cpu") == fields["device_memory"]
    child = ("import inspect\nfrom storage.config import CacheConfig\n"
             "CacheConfig.__dataclass_fields__['disk_reserve'].default = '7MiB'\n"
             "from tieredkv import cli_serve\n"
             "print(inspect.signature(cli_serve.serve).parameters['disk_reserve'].default.default)")
    done = subprocess.run([sys.executable, "-c", child], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip() == "7MiB", done.stderr
