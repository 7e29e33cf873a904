"""README's curl examples run, as printed, against real servers: every `curl` line of "## HTTP
server" against a server serving under the README's model name, and the router example's against
`tieredkv route`'s app in front of two such servers. Also: README's flag table and Grafana
queries say what the code has."""
from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path


from service.settings import ServiceSettings
from tests.service.conftest import ServerThread
from tests.service.router.harness import RouterThread
from tests.service.tiny_engine import build_engine
from tieredkv.cli_flags import FLAG_TABLE

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
MODEL = "SmolLM2-135M-Instruct"          # the name README's examples send


def section(title: str) -> str:
    return README.split(f"\n{title}\n", 1)[1].split("\n## ", 1)[0]


def curl_commands(text: str) -> list[str]:
    """The `curl` commands of a section's bash blocks, continuation lines joined, comments cut."""
    out = []
    for block in re.findall(r"```bash\n(.+?)\n```", text, re.S):
        for cmd in block.replace("\\\n", " ").splitlines():
            cmd = re.sub(r"\s+#.*$", "", cmd).strip()
            if cmd.startswith("curl "):
                out.append(cmd)
    return out


def run_curl(cmd: str, port_from: str, url: str) -> tuple[int, str]:
    """The command with its host:port pointed at `url`; (HTTP status, body)."""
    cmd = cmd.replace(port_from, url.removeprefix("http://"), 1).replace("curl -s", "curl -s -w '\\n%{http_code}'", 1)
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (cmd, r.stderr)
    body, _, status = r.stdout.rpartition("\n")
    return int(status), body


def test_every_curl_in_the_http_server_section_answers_200(tmp_path, tokenizer) -> None:
    commands = curl_commands(section("## HTTP server"))
    assert len(commands) >= 10, commands
    eng = build_engine(tmp_path, tokenizer)
    with ServerThread(eng, ServiceSettings(served_model_name=MODEL)) as s:
        for cmd in commands:
            assert "localhost:8000" in cmd, cmd
            status, body = run_curl(cmd, "localhost:8000", s.url)
            assert status == 200, (cmd, body)
            if "/metrics" not in cmd:
                json.loads(body)                   # JSON, as README shows


def test_the_router_example_answers_200_through_the_router(tmp_path, tokenizer) -> None:
    [cmd] = curl_commands(section("### Behind `tieredkv route`"))
    assert "localhost:8100" in cmd and "content-type: application/json" in cmd
    engines = [build_engine(tmp_path / name, tokenizer) for name in ("a", "b")]
    with ServerThread(engines[0], ServiceSettings(served_model_name=MODEL)) as a, \
            ServerThread(engines[1], ServiceSettings(served_model_name=MODEL)) as b, \
            RouterThread(a.url, b.url) as router:
        deadline = time.monotonic() + 60
        while not all(x["healthy"] for x in router.health()["backends"]):
            assert time.monotonic() < deadline, router.health()
            time.sleep(0.05)
        status, body = run_curl(cmd, "localhost:8100", router.url)
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 8


def test_readme_lists_every_flag_mapping_and_its_grafana_queries_name_vllm_series(client) -> None:
    table = section("## Coming from vLLM or llama-server")
    for flag, _source, meaning in FLAG_TABLE:
        assert flag in table and " ".join(meaning.split()) in " ".join(table.split()), flag
    queries = re.findall(r"```promql\n(.+?)\n```", table, re.S)
    assert queries, "README shows the Grafana panel queries"
    names = set(re.findall(r"(vllm:[a-z_]+)", queries[0]))
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} <= names
    scraped = client.get("/metrics").text
    for name in names:
        series = [ln for ln in scraped.splitlines() if ln.startswith(name + "{")]
        assert series and all('model_name="' in ln for ln in series), name
