"""`generate`: the openai engine over real HTTP against the local endpoint (a separate process serving the tiny target),
and the hf engine in process. The endpoint is killed midway and restarted; faults are injected by the server itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zstandard

from blockdraft.config import load_config
from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.stages.generate.stage import FAILURES_NAME, SHARDS_DIR, generate
from blockdraft.store import open_store
from blockdraft.store.artifact import State, verify_artifact

TINY = TINY_TARGET_DIR



class Endpoint:
    """`python -m blockdraft.stages.generate.server` as a child process; `url` is its /v1 base."""

    def __init__(self, log: Path, faults: str = "", delay_s: float = 0.0) -> None:
        self.log = log
        cmd = [sys.executable, "-m", "blockdraft.stages.generate.server", str(TINY), "--port", "0", "--request-log", str(log),
               "--faults", faults, "--delay-s", str(delay_s)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()  # blocks until the server listens (or dies)
        if not line.startswith("listening on "):
            self.stop()
            raise RuntimeError(f"the endpoint did not start: {line!r}")
        self.url = line.split()[-1] + "/v1"

    def events(self) -> list[dict]:
        if not self.log.exists():
            return []
        return [json.loads(x) for x in self.log.read_text().splitlines() if x.strip()]

    def arrived(self) -> list[str]:
        """Request ids in arrival order."""
        return [e["request_id"] for e in self.events() if "arrived" in e]

    def answered(self, status: int = 200) -> list[str]:
        return [e["request_id"] for e in self.events() if e.get("status") == status]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


@pytest.fixture
def endpoints():
    started: list[Endpoint] = []

    def start(log: Path, **kwargs) -> Endpoint:
        started.append(Endpoint(log, **kwargs))
        return started[-1]

    yield start
    for endpoint in started:
        endpoint.stop()


def write_prompts(path: Path, n: int) -> list[str]:
    rows = [json.loads(x) for x in (TINY / "prompts.jsonl").read_text().splitlines()[:n]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [r["id"] for r in rows]


def openai_config(url: str, **generate) -> object:
    values = {"engine": "openai", "base_url": url, "max_new_tokens": 40, "concurrency": 2, "timeout_s": 30.0,
              "max_retries": 2, "retry_backoff_s": 0.05, "rows_per_shard": 2}
    values.update(generate)
    return load_config(None, {"generate": values})


def output_rows(out: Path) -> list[dict]:
    rows = []
    for shard in sorted((out / SHARDS_DIR).glob("*.jsonl.zst")):
        text = zstandard.ZstdDecompressor().decompressobj().decompress(shard.read_bytes()).decode()
        rows += [json.loads(x) for x in text.splitlines() if x.strip()]
    return rows


def test_endpoint_killed_midway_then_rerun_generates_only_the_missing_prompts(tmp_path, endpoints):
    ids = write_prompts(tmp_path / "prompts.jsonl", 12)
    out = tmp_path / "completions"
    first = endpoints(tmp_path / "first.log")

    def kill_after_four_answers() -> None:
        deadline = time.monotonic() + 300
        while len(first.answered()) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        first.kill()

    killer = threading.Thread(target=kill_after_four_answers)
    killer.start()
    run1 = generate(str(tmp_path / "prompts.jsonl"), str(out), openai_config(first.url))
    killer.join()

    assert run1.failed > 0 and run1.generated >= 4
    assert run1.generated + run1.failed == 12
    assert set(run1.reasons) == {"connection"}
    failures = [json.loads(x) for x in (out / FAILURES_NAME).read_text().splitlines()]
    failed_ids = {f["id"] for f in failures}
    assert len(failed_ids) == run1.failed and all(f["kind"] == "failed_request" and f["attempts"] == 3 for f in failures)
    done_ids = {r["id"] for r in output_rows(out)}
    assert done_ids.isdisjoint(failed_ids) and done_ids | failed_ids == set(ids)
    assert run1.report.state is State.VERIFIED and run1.report.manifest.counts["failed"] == run1.failed

    second = endpoints(tmp_path / "second.log")
    run2 = generate(str(tmp_path / "prompts.jsonl"), str(out), openai_config(second.url))
    assert (run2.reused, run2.generated, run2.failed) == (len(done_ids), len(failed_ids), 0)
    served = second.arrived()
    assert set(served) == failed_ids and len(served) == len(failed_ids)

    rows = output_rows(out)
    assert sorted(r["id"] for r in rows) == sorted(ids)  # every prompt exactly once
    assert all(r["messages"][-1]["role"] == "assistant" and r["completion_token_ids"] for r in rows)
    # Each prompt's thinking mode reached the server's chat template as chat_template_kwargs.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    modes = {r["id"]: r["enable_thinking"] for r in map(json.loads, (tmp_path / "prompts.jsonl").read_text().splitlines())}
    assert set(modes.values()) == {True, False}
    for r in rows:
        assert r["thinking"] == ("on" if modes[r["id"]] else "off")
        served_prompt = tok.decode(r["prompt_token_ids"])
        assert served_prompt.endswith("<think>\n\n</think>\n\n") != modes[r["id"]]
    assert run2.report.state is State.VERIFIED and run2.report.manifest.counts["rows"] == 12
    assert (out / FAILURES_NAME).read_text() == ""

    run3 = generate(str(tmp_path / "prompts.jsonl"), str(out), openai_config(second.url))
    assert run3.already_complete and run3.generated == 0 and len(second.arrived()) == len(failed_ids)


def test_injected_5xx_and_timeouts_are_retried_then_recorded(tmp_path, endpoints):
    ids = write_prompts(tmp_path / "prompts.jsonl", 5)
    with open(tmp_path / "prompts.jsonl", "a") as f:  # a role the tiny template refuses: the server answers 400
        f.write(json.dumps({"id": "tool-turn", "messages": [{"role": "tool", "content": "42"}]}) + "\n")
    # One request at a time, 3 attempts each: prompt 0 gets 503 x3 (recorded), prompt 1 times out x3 (recorded),
    # prompt 2 gets a 503 then succeeds, prompt 3 times out once then succeeds.
    server = endpoints(tmp_path / "faults.log", faults="503,503,503,delay,delay,delay,503,ok,delay", delay_s=6.0)
    cfg = openai_config(server.url, concurrency=1, timeout_s=2.0, rows_per_shard=10)
    run = generate(str(tmp_path / "prompts.jsonl"), str(tmp_path / "out"), cfg)

    failures = {f["id"]: f for f in map(json.loads, (tmp_path / "out" / FAILURES_NAME).read_text().splitlines())}
    assert failures[ids[0]]["reason"] == "http_503" and failures[ids[0]]["attempts"] == 3
    assert failures[ids[1]]["reason"] == "timeout" and failures[ids[1]]["attempts"] == 3
    assert failures["tool-turn"]["reason"] == "http_400" and failures["tool-turn"]["attempts"] == 1  # not retried
    assert "no role tool" in failures["tool-turn"]["detail"]
    assert run.reasons == {"http_503": 1, "timeout": 1, "http_400": 1} and run.failed == 3 and run.generated == 3
    assert {r["id"] for r in output_rows(tmp_path / "out")} == set(ids[2:])
    counts = run.report.manifest.counts
    assert counts["failed"] == 3 and counts["reasons"] == run.reasons
    assert server.arrived() == [ids[0]] * 3 + [ids[1]] * 3 + [ids[2]] * 2 + [ids[3]] * 2 + [ids[4], "tool-turn"]

    # The script is spent: a rerun generates the two prompts that failed on faults, and records the bad one again.
    rerun = generate(str(tmp_path / "prompts.jsonl"), str(tmp_path / "out"), cfg)
    assert (rerun.reused, rerun.generated, rerun.failed, rerun.reasons) == (3, 2, 1, {"http_400": 1})
    assert sorted(r["id"] for r in output_rows(tmp_path / "out")) == sorted(ids)


def test_hf_engine_regenerates_the_final_turn_with_exact_token_ids(tmp_path):
    from transformers import AutoTokenizer

    conversations = [json.loads(x) for x in (TINY / "completions.jsonl").read_text().splitlines()[:5]]
    rows = conversations + [
        {"id": "no-user", "messages": [{"role": "system", "content": "hi"}]},
        {"id": conversations[0]["id"], "messages": [{"role": "user", "content": "again"}]},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "{broken\n")
    cfg = load_config(None, {"target": {"path": str(TINY)}, "generate": {"engine": "hf", "max_new_tokens": 120, "batch_size": 4}})
    run = generate(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), cfg)
    assert run.report.state is State.VERIFIED and run.generated == 5
    assert run.reasons == {"no_user_turn": 1, "duplicate_id": 1, "bad_json": 1} and run.bad_prompts == 3

    tok = AutoTokenizer.from_pretrained(TINY)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    by_id = {r["id"]: r for r in output_rows(tmp_path / "out")}
    for conv in conversations:
        row = by_id[conv["id"]]
        prompt = conv["messages"][:-1]
        assert row["messages"][:-1] == prompt  # the final assistant turn was dropped and regenerated
        thinking = bool(conv["messages"][-1]["reasoning_content"])
        assert row["thinking"] == ("on" if thinking else "off")
        rendered = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
        assert row["prompt_token_ids"] == tok(rendered, add_special_tokens=False)["input_ids"]
        if row["finish_reason"] == "stop":
            assert row["completion_token_ids"][-1] == eos
        # The tiny target reproduces its own greedy completions from the fixture.
        assert row["messages"][-1]["content"] == conv["messages"][-1]["content"]

    again = generate(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), cfg)
    assert again.already_complete and again.reused == 5

    # The artifact is tokenize's input as it is: every row trained from the generator's token ids, nothing rejected.
    from blockdraft.stages.tokenize.stage import tokenize_dataset

    tokenized = tokenize_dataset(str(tmp_path / "out"), str(tmp_path / "tok"), cfg)
    assert tokenized.counts["rows_out"] == 5 and tokenized.counts["rejected"] == {}
    assert tokenized.counts["thinking"] == {"generator": 5}


def test_generate_cli_refuses_other_settings_on_the_same_output(tmp_path):
    ids = write_prompts(tmp_path / "p.jsonl", 2)
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text(f'[target]\npath = "{TINY.as_posix()}"\n[generate]\nengine = "hf"\nmax_new_tokens = 8\n')
    first = generate(str(tmp_path / "p.jsonl"), str(tmp_path / "o"), load_config(cfg_file))
    assert first.generated == 2 and len(output_rows(tmp_path / "o")) == len(ids)
    cmd = [str(Path(sys.executable).parent / "blockdraft"), "generate", str(tmp_path / "p.jsonl"), str(tmp_path / "o"),
           "--config", str(cfg_file), "--max-new-tokens", "9"]
    other = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert other.returncode == 2
    assert "other generate settings (max_new_tokens)" in other.stderr and "Traceback" not in other.stderr
    assert verify_artifact(open_store(str(tmp_path / "o"))).state is State.VERIFIED  # left as it was
