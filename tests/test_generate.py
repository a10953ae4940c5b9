"""`generate`: the openai engine over real HTTP against the local endpoint (a separate process serving the tiny target,
or an in-process server whose faults are scripted), and the hf engine in process. The endpoint is killed midway and
restarted; a held request never answers, so its timeout fires for certain; reruns keep finished pieces without reading
a shard."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import zstandard
from helpers import tokenize_data
from helpers.chat_server import ChatServer, EndpointProcess, FaultPlan
from helpers.generate_data import output_rows
from helpers.paths import TOKENIZER_DIR
from helpers.reporters import ProgressLog
from transformers import AutoTokenizer

from blockdraft.config import load_config
from blockdraft.data.chat import Completion, Prompt, render_prompt
from blockdraft.errors import ConfigError
from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.reporter import Reporter
from blockdraft.stages import generate
from blockdraft.stages.generate import FAILURES_NAME, SETTINGS_NAME, SHARDS_DIR
from blockdraft.store import open_store
from blockdraft.store.artifact import MANIFEST_NAME, State, verify_artifact

TINY = TINY_TARGET_DIR
CLI = str(Path(sys.executable).parent / "blockdraft")


@pytest.fixture
def endpoints():
    """Start `EndpointProcess`es of the tiny target; all stopped at the end."""
    started: list[EndpointProcess] = []

    def start(log: Path, faults: str = "") -> EndpointProcess:
        started.append(EndpointProcess(TINY, log, faults))
        return started[-1]

    yield start
    for endpoint in started:
        endpoint.stop()


class TemplateChat:
    """Answers at once without a model: the prompt is rendered with the tiny target's real chat template (so a prompt
    the template refuses gets the real error, answered 400), and the answer is a fixed one ending with end-of-turn."""

    name = "template-chat"

    def __init__(self) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(TINY)

    def complete(self, prompt: Prompt, max_tokens: int, temperature: float) -> Completion:
        ids = self.tokenizer(render_prompt(self.tokenizer, prompt), add_special_tokens=False)["input_ids"]
        answer = self.tokenizer("fixed answer<|im_end|>", add_special_tokens=False)["input_ids"]
        return Completion(prompt.id, "fixed answer", "", "stop", ids, answer)


def write_prompts(path: Path, n: int) -> list[str]:
    rows = [json.loads(x) for x in (TINY / "prompts.jsonl").read_text().splitlines()[:n]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [r["id"] for r in rows]


def openai_config(url: str, **options):
    values = {"engine": "openai", "base_url": url, "max_new_tokens": 40, "concurrency": 2, "timeout_s": 30.0,
              "max_retries": 2, "retry_backoff_s": 0.05, "rows_per_shard": 2}
    return load_config(None, {"generate": {**values, **options}})


def hf_config(**options):
    return load_config(None,
                       {"target": {"path": str(TINY)}, "generate": {"engine": "hf", "max_new_tokens": 8, **options}})


def run(input: Path, output: Path, cfg, reporter: Reporter | None = None):
    return generate.run(cfg, str(input), str(output), reporter or Reporter())




def shard_files(out: Path) -> dict[str, tuple[int, int]]:
    """{shard name: (inode, mtime_ns)}: a rewritten shard gets a new inode (every write is a rename into place)."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted((out / SHARDS_DIR).glob("*.jsonl.zst"))}


@pytest.mark.slow
@pytest.mark.fault
def test_endpoint_killed_midway_then_rerun_generates_only_the_missing_prompts(tmp_path, endpoints):
    ids = write_prompts(tmp_path / "prompts.jsonl", 12)
    out = tmp_path / "completions"
    # Four requests are answered, the next two (both slots of concurrency 2) are held: the run cannot get further,
    # however fast the machine, until the endpoint is killed under the held requests. The second endpoint serves the
    # rerun; both start side by side (each process loads torch and the model, seconds), and nothing reaches the second
    # before the rerun.
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda args: endpoints(*args),
                                 [(tmp_path / "first.log", "ok,ok,ok,ok,hold,hold"), (tmp_path / "second.log", "")])

    def kill_once_two_requests_are_held() -> None:
        deadline = time.monotonic() + 300  # bounds a hang only; the kill comes as soon as both are held
        while len(first.arrived()) < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        first.kill()

    killer = threading.Thread(target=kill_once_two_requests_are_held)
    killer.start()
    # Its only server gone, the run ends once no server has answered for servers_down_timeout_s (here timeout_s, the
    # longer): the prompts not done are recorded as failed, with the line that says why, and the run says it once.
    said = Reporter()
    run1 = run(tmp_path / "prompts.jsonl", out, openai_config(first.url, timeout_s=10.0, servers_down_timeout_s=2.0),
               said)
    killer.join()
    assert (run1.details.generated, run1.details.failed, run1.details.reasons) == (4, 8, {"servers_down": 8})
    # committed with its failures counted: partial, and a rerun goes on
    assert run1.report.state is State.VERIFIED and run1.report.manifest.counts["failed"] == 8
    down = (r"no generate server answered for \d+ s \(http://127\.0\.0\.1:\d+/v1: (cannot reach|connection to) .*\); "
            r"the 8")
    assert len(said.warnings) == 1 and re.match(down, said.warnings[0])
    failures = [json.loads(x) for x in (out / FAILURES_NAME).read_text().splitlines()]
    assert all(f["reason"] == "servers_down" and re.match(down, f["detail"]) for f in failures)
    done_ids = {r["id"] for r in output_rows(out)}
    assert len(done_ids) == 4 and done_ids.isdisjoint(f["id"] for f in failures)

    assert second.arrived() == []
    run2 = run(tmp_path / "prompts.jsonl", out, openai_config(second.url))
    assert (run2.details.reused, run2.details.generated, run2.details.failed) == (4, 8, 0)
    served = second.arrived()
    assert set(served) == set(ids) - done_ids and len(served) == 8

    rows = output_rows(out)
    assert sorted(r["id"] for r in rows) == sorted(ids)  # every prompt exactly once
    assert all(r["messages"][-1]["role"] == "assistant" and r["completion_token_ids"] for r in rows)
    # Each prompt's thinking mode reached the server's chat template as chat_template_kwargs.
    tok = AutoTokenizer.from_pretrained(TINY)
    modes = {r["id"]: r["enable_thinking"]
             for r in map(json.loads, (tmp_path / "prompts.jsonl").read_text().splitlines())}
    assert set(modes.values()) == {True, False}
    for r in rows:
        assert r["thinking"] == ("on" if modes[r["id"]] else "off")
        served_prompt = tok.decode(r["prompt_token_ids"])
        assert served_prompt.endswith("<think>\n\n</think>\n\n") != modes[r["id"]]
    assert run2.report.state is State.VERIFIED and run2.report.manifest.counts["rows"] == 12
    assert (out / FAILURES_NAME).read_text() == ""

    run3 = run(tmp_path / "prompts.jsonl", out, openai_config(second.url))
    assert run3.already_done and run3.details.generated == 0 and len(second.arrived()) == 8
    assert generate.summary_lines(run3)[0] == f"verified: {out} (already complete, nothing generated)"


@pytest.mark.fault
@pytest.mark.slow
def test_injected_5xx_and_timeouts_are_retried_then_recorded(tmp_path):
    ids = write_prompts(tmp_path / "prompts.jsonl", 5)
    with open(tmp_path / "prompts.jsonl", "a") as f:  # a role the tiny template refuses: the server answers 400
        f.write(json.dumps({"id": "tool-turn", "messages": [{"role": "tool", "content": "42"}]}) + "\n")
    # One request at a time, 3 attempts each: prompt 0 gets 503 x3 (recorded), prompt 1 is held x3, so it times out
    # x3 (recorded), prompt 2 gets a 503 then succeeds, prompt 3 is held once then succeeds. A held request never
    # answers, so its timeout fires however slow the machine is; the others are answered at once, without a model.
    faults = FaultPlan.parse("503,503,503,hold,hold,hold,503,ok,hold")
    with ChatServer(TemplateChat(), faults=faults) as server:
        cfg = openai_config(server.url, concurrency=1, timeout_s=1.0, rows_per_shard=10)
        result = run(tmp_path / "prompts.jsonl", tmp_path / "out", cfg)

        failures = {f["id"]: f for f in map(json.loads, (tmp_path / "out" / FAILURES_NAME).read_text().splitlines())}
        assert failures[ids[0]]["reason"] == "http_503" and failures[ids[0]]["attempts"] == 3
        assert failures[ids[1]]["reason"] == "timeout" and failures[ids[1]]["attempts"] == 3
        assert failures["tool-turn"]["reason"] == "http_400" and failures["tool-turn"]["attempts"] == 1  # not retried
        assert "no role tool" in failures["tool-turn"]["detail"]
        summary = result.details
        assert (
            summary.reasons == {"http_503": 1, "timeout": 1, "http_400": 1}
            and summary.failed == 3
            and summary.generated == 3
        )
        assert {r["id"] for r in output_rows(tmp_path / "out")} == set(ids[2:])
        counts = result.report.manifest.counts
        assert counts["failed"] == 3 and counts["reasons"] == summary.reasons
        assert server.arrived() == [ids[0]] * 3 + [ids[1]] * 3 + [ids[2]] * 2 + [ids[3]] * 2 + [ids[4], "tool-turn"]

        # The script is spent: a rerun generates the two prompts that failed on faults, and records the bad one again.
        rerun = run(tmp_path / "prompts.jsonl", tmp_path / "out", cfg)
        assert ((rerun.details.reused, rerun.details.generated, rerun.details.failed, rerun.details.reasons)
                == (3, 2, 1, {"http_400": 1}))
        assert sorted(r["id"] for r in output_rows(tmp_path / "out")) == sorted(ids)

        # The served model name, asked from the server when not configured, is what the completions were made with:
        # naming it is the same settings, naming another model is not.
        same = run(tmp_path / "prompts.jsonl", tmp_path / "out", openai_config(server.url, model=TemplateChat.name))
        assert (same.details.reused, same.details.generated) == (5, 0)
        with pytest.raises(ConfigError, match=r"other generate settings \(model\)"):
            run(tmp_path / "prompts.jsonl", tmp_path / "out", openai_config(server.url, model="another-model"))


@pytest.mark.slow
def test_hf_engine_regenerates_the_final_turn_with_exact_token_ids(tmp_path):
    conversations = [json.loads(x) for x in (TINY / "completions.jsonl").read_text().splitlines()[:5]]
    rows = conversations + [
        {"id": "no-user", "messages": [{"role": "system", "content": "hi"}]},
        {"id": conversations[0]["id"], "messages": [{"role": "user", "content": "again"}]},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "{broken\n")
    cfg = hf_config(max_new_tokens=120, batch_size=4)
    result = run(tmp_path / "in.jsonl", tmp_path / "out", cfg)
    assert result.report.state is State.VERIFIED and result.details.generated == 5
    assert (
        result.details.reasons == {"no_user_turn": 1, "duplicate_id": 1, "bad_json": 1}
        and result.details.bad_prompts == 3
    )

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

    again = run(tmp_path / "in.jsonl", tmp_path / "out", cfg)
    assert again.already_done and again.details.reused == 5

    # The artifact is tokenize's input as it is: every row trained from the generator's token ids, nothing rejected.
    config = tmp_path / "c.toml"
    config.write_text(f'[target]\npath = "{TINY.as_posix()}"\n')
    tokenize = subprocess.run([CLI, "tokenize", str(tmp_path / "out"), str(tmp_path / "tok"), "--config", str(config)],
                              capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert tokenize.returncode == 0, tokenize.stderr
    counts = verify_artifact(open_store(str(tmp_path / "tok"))).manifest.counts
    assert counts["rows_out"] == 5 and counts["rejected"] == {} and counts["thinking"] == {"generator": 5}


@pytest.mark.fault
def test_rerun_keeps_finished_pieces_without_reading_a_shard(tmp_path, monkeypatch):
    write_prompts(tmp_path / "p.jsonl", 3)
    out = tmp_path / "o"
    cfg = hf_config(rows_per_shard=1)
    first = run(tmp_path / "p.jsonl", out, cfg)
    assert first.details.generated == 3 and len(shard_files(out)) == 3
    shards, manifest = shard_files(out), (out / MANIFEST_NAME).read_bytes()

    class NoShardReading:
        def __init__(self, *args, **kwargs):
            raise AssertionError("a rerun decompressed a shard")

    monkeypatch.setattr(zstandard, "ZstdDecompressor", NoShardReading)
    done = run(tmp_path / "p.jsonl", out, cfg)
    assert done.already_done and done.details.reused == 3
    assert (out / MANIFEST_NAME).read_bytes() == manifest and shard_files(out) == shards

    # A run killed after its last piece but before its commit, with one more shard uploaded whose piece was never
    # recorded.
    (out / MANIFEST_NAME).unlink()
    (out / SHARDS_DIR / "part-00003.jsonl.zst").write_bytes(b"torn upload")
    resumed = run(tmp_path / "p.jsonl", out, cfg)
    assert not resumed.already_done and resumed.report.state is State.VERIFIED
    assert (resumed.details.reused, resumed.details.generated, resumed.details.failed) == (3, 0, 0)
    assert shard_files(out) == shards  # the finished ones untouched, the torn one deleted
    assert resumed.report.manifest.counts["rows"] == 3


@pytest.mark.fault
def test_a_piece_made_with_other_settings_is_refused(tmp_path):
    write_prompts(tmp_path / "p.jsonl", 2)
    out = tmp_path / "o"
    run(tmp_path / "p.jsonl", out, hf_config())
    # Only the pieces are left to tell: no manifest, no generate.settings.
    (out / MANIFEST_NAME).unlink()
    (out / SETTINGS_NAME).unlink()
    shards = shard_files(out)
    with pytest.raises(ConfigError, match=r"holds completions made with other generate settings \(piece part-00000\); "
                                          r"write to a new OUTPUT"):
        run(tmp_path / "p.jsonl", out, hf_config(max_new_tokens=9))
    assert shard_files(out) == shards  # nothing was removed
    # the settings they were made with are still welcome
    assert run(tmp_path / "p.jsonl", out, hf_config()).details.reused == 2


def test_an_output_of_other_prompts_is_refused(tmp_path):
    write_prompts(tmp_path / "p.jsonl", 2)
    run(tmp_path / "p.jsonl", tmp_path / "o", hf_config())
    (tmp_path / "q.jsonl").write_text((tmp_path / "p.jsonl").read_text().splitlines()[0] + "\n")
    with pytest.raises(ConfigError, match=r"holds 1 completions whose prompts are not in"):
        run(tmp_path / "q.jsonl", tmp_path / "o", hf_config())


def test_generate_cli_refuses_other_settings_on_the_same_output(tmp_path):
    ids = write_prompts(tmp_path / "p.jsonl", 2)
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text(f'[target]\npath = "{TINY.as_posix()}"\n[generate]\nengine = "hf"\nmax_new_tokens = 8\n')
    first = run(tmp_path / "p.jsonl", tmp_path / "o", load_config(cfg_file))
    assert first.details.generated == 2 and len(output_rows(tmp_path / "o")) == len(ids)
    cmd = [CLI, "generate", str(tmp_path / "p.jsonl"), str(tmp_path / "o"), "--config", str(cfg_file),
           "--max-new-tokens", "9"]
    other = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert other.returncode == 2
    assert "other generate settings (max_new_tokens)" in other.stderr and "Traceback" not in other.stderr
    assert verify_artifact(open_store(str(tmp_path / "o"))).state is State.VERIFIED  # left as it was

    same = subprocess.run(cmd[:-2], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert same.returncode == 0, same.stderr
    assert (
        "(already complete, nothing generated)" in same.stderr
        and "prompts 2: reused 2, generated 0, failed 0" in same.stderr
    )


def per_row_prompts(path: Path) -> list[dict]:
    """Four prompts of the tiny target's: one on the config's settings, two with their own, one with a bad setting."""
    rows = [json.loads(x) for x in (TINY / "prompts.jsonl").read_text().splitlines()[:4]]
    rows[1].update(temperature=0.7, top_p=0.9, max_new_tokens=5, reasoning_effort="high", group="asked-twice")
    rows[2].update(enable_thinking=False, temperature=0, max_new_tokens=7)
    rows[3].update(top_p=1.5)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_per_row_settings_reach_the_request_and_the_completion(tmp_path):
    rows = per_row_prompts(tmp_path / "p.jsonl")
    with ChatServer(TemplateChat()) as server:
        result = run(tmp_path / "p.jsonl", tmp_path / "o", openai_config(server.url, max_new_tokens=40,
                                                                        thinking="on"))
        sent = {e["request_id"]: e["sampling"] for e in server.events() if "arrived" in e}
    assert result.details.generated == 3 and result.details.reasons == {"bad_setting": 1}
    failure = json.loads((tmp_path / "o" / FAILURES_NAME).read_text())
    assert (failure["id"], failure["reason"]) == (rows[3]["id"], "bad_setting") and "top_p is 1.5" in failure["detail"]
    plain, own, greedy = (r["id"] for r in rows[:3])
    # The config's settings where a row sets none; the row's own where it does, thinking included.
    assert sent[plain] == {"max_tokens": 40, "temperature": 0.0, "chat_template_kwargs": {"enable_thinking": True}}
    assert sent[own] == {"max_tokens": 5, "temperature": 0.7, "top_p": 0.9,
                         "chat_template_kwargs": {"enable_thinking": True, "reasoning_effort": "high"}}
    assert sent[greedy] == {"max_tokens": 7, "temperature": 0.0, "chat_template_kwargs": {"enable_thinking": False}}
    done = {r["id"]: r for r in output_rows(tmp_path / "o")}
    assert done[plain]["settings"] == {"temperature": 0.0, "max_new_tokens": 40}
    assert done[own]["settings"] == {"temperature": 0.7, "max_new_tokens": 5, "top_p": 0.9, "reasoning_effort": "high"}
    assert done[own]["group"] == "asked-twice" and "group" not in done[plain]  # tokenize holds a group out together
    assert (done[greedy]["settings"], done[greedy]["thinking"]) == ({"temperature": 0.0, "max_new_tokens": 7}, "off")
    # Counted in the artifact's summary, read back from the destination's manifest.
    assert result.details.settings == {
        "max_new_tokens=<=64": 1, "max_new_tokens=<=8": 2, "reasoning_effort=high": 1,
        "temperature=0": 2, "temperature=0.7": 1, "top_p=0.9": 1,
    }
    # A rerun reads them from the manifest (the server is gone: nothing is asked of it).
    again = run(tmp_path / "p.jsonl", tmp_path / "o", openai_config(server.url, max_new_tokens=40, thinking="on"))
    assert again.already_done and again.details.settings == result.details.settings
    assert "generated with: max_new_tokens=<=64 (1 rows), max_new_tokens=<=8 (2 rows), " in "\n".join(
        generate.summary_lines(again))


@pytest.mark.slow
def test_hf_engine_samples_each_row_with_its_own_settings_reproducibly(tmp_path):
    """The hf engine: rows on their own temperature and length beside greedy ones in one batch; the greedy row is the
    config's greedy answer, and sampled rows come out the same on a rerun into a new output (seeded)."""
    base = json.loads((TINY / "prompts.jsonl").read_text().splitlines()[0])
    rows = [{**base, "id": "greedy"}, {**base, "id": "hot-a", "temperature": 1.5, "max_new_tokens": 6},
            {**base, "id": "hot-b", "temperature": 1.5, "max_new_tokens": 6}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "g.jsonl").write_text(json.dumps(rows[0]) + "\n")
    cfg = hf_config(max_new_tokens=12, batch_size=3)
    for source, out in (("p", "o1"), ("p", "o2"), ("g", "g")):
        assert run(tmp_path / f"{source}.jsonl", tmp_path / out, cfg).report.state is State.VERIFIED
    first, second = ({r["id"]: r for r in output_rows(tmp_path / out)} for out in ("o1", "o2"))
    alone = output_rows(tmp_path / "g")[0]
    assert first["greedy"]["completion_token_ids"] == alone["completion_token_ids"]
    assert first["greedy"]["settings"] == {"temperature": 0.0, "max_new_tokens": 12}
    assert first["hot-a"]["settings"] == {"temperature": 1.5, "max_new_tokens": 6}
    assert all(len(first[i]["completion_token_ids"]) <= 6 for i in ("hot-a", "hot-b"))
    # Sampled: the two hot rows differ from each other (one draw each), and a rerun draws the same.
    assert first["hot-a"]["completion_token_ids"] != first["hot-b"]["completion_token_ids"]
    assert all(first[i]["completion_token_ids"] == second[i]["completion_token_ids"] for i in first)


@pytest.mark.fault
def test_two_servers_one_killed_midway_every_prompt_done_exactly_once(tmp_path):
    """Requests spread over two servers; one answers two, holds two, and is then shut down under them: its held and
    later requests go to the other server, every prompt is generated exactly once, and the progress line shows each
    server's share and the dead one resting."""
    rows = [{**json.loads((TINY / "prompts.jsonl").read_text().splitlines()[i % 4]), "id": f"p{i:02d}"}
            for i in range(20)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    doomed = ChatServer(TemplateChat(), faults=FaultPlan.parse("ok,ok,hold,hold")).__enter__()
    with ChatServer(TemplateChat()) as steady:
        def kill_once_two_are_held() -> None:
            deadline = time.monotonic() + 60  # bounds a hang only
            while len(doomed.arrived()) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            doomed.__exit__(None, None, None)  # the held requests are dropped unanswered, new ones refused

        killer = threading.Thread(target=kill_once_two_are_held)
        killer.start()
        progress = ProgressLog()
        result = run(tmp_path / "p.jsonl", tmp_path / "o", openai_config([doomed.url, steady.url], concurrency=2,
                                                                        rows_per_shard=3), progress)
        killer.join()
        answered_by_steady = steady.answered()
    assert result.report.state is State.VERIFIED
    assert (result.details.generated, result.details.failed) == (20, 0)
    done = [r["id"] for r in output_rows(tmp_path / "o")]
    assert sorted(done) == [r["id"] for r in rows]  # none lost, none twice
    assert len(doomed.answered()) == 2 and len(answered_by_steady) == 18
    assert set(doomed.arrived()[2:4]) <= set(answered_by_steady)  # the held two were served by the other server
    line = progress.calls[-1][3]["servers"]
    host = doomed.url.removeprefix("http://").removesuffix("/v1")
    assert f"{host} 2 done" in line and f"{steady.url.removeprefix('http://').removesuffix('/v1')} 18 done" in line
    assert "(down)" in line.split(",")[0]


@pytest.mark.fault
def test_a_server_listed_twice_is_refused():
    with pytest.raises(ConfigError, match="names http://127.0.0.1:8000/v1 twice; list each server once"):
        openai_config(["http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"])


@pytest.mark.slow
def test_every_turn_is_the_targets_greedy_answer_to_its_own_history(tmp_path):
    """generate.turns = "all" on two-turn conversations (engine hf, batched): each assistant turn equals the target's
    greedy continuation of the history it wrote itself, computed here one conversation and one turn at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    fixture = [json.loads(x) for x in (TINY / "completions.jsonl").read_text().splitlines()]
    conversations = [c for c in fixture if sum(m["role"] == "assistant" for m in c["messages"]) == 2][:4]
    single = [c for c in fixture if sum(m["role"] == "assistant" for m in c["messages"]) == 1][:1]
    prompt_only = [{"id": "ends-with-user", "messages": conversations[0]["messages"][:3]}]
    rows = conversations + single + prompt_only
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = hf_config(max_new_tokens=24, batch_size=3, turns="all", thinking="off")
    result = run(tmp_path / "in.jsonl", tmp_path / "out", cfg)
    assert result.report.state is State.VERIFIED and result.details.generated == len(rows)
    done = {r["id"]: r for r in output_rows(tmp_path / "out")}

    tok = AutoTokenizer.from_pretrained(TINY)
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for row in rows:
        history, expected = [], []
        given = [m for m in row["messages"] if m["role"] != "assistant"]
        # the given turns in order, an answer after each user turn (what the regenerated row holds)
        for message in given:
            history.append(message)
            if message["role"] != "user":
                continue
            text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True, enable_thinking=False)
            ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=eos)
            new = out[0, ids.shape[1]:].tolist()
            answer = tok.decode(new[: new.index(eos)] if eos in new else new, skip_special_tokens=True)
            expected.append(answer.split("</think>")[-1].strip())
            history.append({"role": "assistant", "content": expected[-1]})
        got = done[row["id"]]
        assert [m["content"] for m in got["messages"] if m["role"] == "assistant"] == expected, row["id"]
        assert [m for m in got["messages"] if m["role"] != "assistant"] == given  # the given turns kept as they are
        assistant_at = [i for i, m in enumerate(got["messages"]) if m["role"] == "assistant"]
        assert got["regenerated_turns"] == assistant_at and "completion_token_ids" not in got
    # tokenize supervises every regenerated turn: one training row per assistant turn
    from blockdraft.stages import tokenize as tokenize_stage

    tokenized = tokenize_stage.run(load_config(None, {"target": {"path": str(TINY)}, "tokenize": {"thinking": "off"}}),
                                   str(tmp_path / "out"), str(tmp_path / "tok"))
    turns = sum(len(r["regenerated_turns"]) for r in done.values())
    assert tokenized.details.counts["rows_out"] == turns == 2 * len(conversations) + 1 + 2


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class ToolChat:
    """A server of the Qwen3 chat template that calls `get_weather` for a user turn and answers in words after the
    tool's result, as a tool parser returns it (OpenAI `tool_calls`, no token ids); the prompt is rendered with the
    tools."""

    name = "tool-chat"

    def __init__(self) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
        self.rendered: list[str] = []

    def complete(self, prompt: Prompt, max_tokens: int, temperature: float) -> Completion:
        self.rendered.append(render_prompt(self.tokenizer, prompt))
        if prompt.messages[-1]["role"] == "tool":
            return Completion(prompt.id, "It is 18 C and sunny in Lyon.", "", "stop")
        call = {"id": "call_0", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": json.dumps({"city": "Lyon"})}}
        return Completion(prompt.id, "", "", "tool_calls", tool_calls=[call])


def test_a_tool_calling_conversation_round_trips_generate_then_tokenize(tmp_path):
    """Every turn regenerated through the server: the tools reach the request and the template, the target's tool call
    comes back in OpenAI form, the tool's result is kept, and tokenize supervises the call as the target made it."""
    row = {"id": "weather", "tools": [WEATHER_TOOL], "messages": [
        {"role": "user", "content": "Is it warm in Lyon right now?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "old", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Nice\"}"}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "{\"temperature_c\": 18, \"sky\": \"sunny\"}"},
        {"role": "assistant", "content": "Yes."}]}
    (tmp_path / "p.jsonl").write_text(json.dumps(row) + "\n")
    chat = ToolChat()
    with ChatServer(chat) as server:
        result = run(tmp_path / "p.jsonl", tmp_path / "o", openai_config(server.url, turns="all", thinking="off"))
        sent = [e["sampling"] for e in server.events() if "arrived" in e]
    assert result.details.generated == 1 and result.details.failed == 0
    assert [s["tools"] for s in sent] == [[WEATHER_TOOL]] * 2
    assert all("<tools>" in text and "get_weather" in text for text in chat.rendered)  # the template saw them
    [done] = output_rows(tmp_path / "o")
    assert done["tools"] == [WEATHER_TOOL]
    call, tool, answer = done["messages"][1:]
    assert call["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": "{\"city\": \"Lyon\"}"}
    assert tool == row["messages"][2] and answer["content"] == "It is 18 C and sunny in Lyon."

    tokenized = tokenize_data.tokenize(str(tmp_path / "o"), str(tmp_path / "tok"), tokenize_data.config(thinking="off"))
    assert tokenized.details.counts["rows_out"] == 2 and tokenized.details.counts["rejected"] == {}
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    supervised = [tok.decode([t for t, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m])
                  for r in tokenize_data.rows_of(tmp_path / "tok")["train"]]
    assert any("<tool_call>" in s and "\"name\": \"get_weather\"" in s and "Lyon" in s for s in supervised), supervised
    assert any("sunny in Lyon" in s for s in supervised)
    assert not any("temperature_c" in s for s in supervised)  # the tool's result is context, never supervised


def test_turns_all_regenerates_only_turns_that_answer_something():
    """An assistant turn that opens a conversation (a greeting) or follows another assistant turn answers nothing: it
    is kept as given, and the turns that answer a user or tool turn are regenerated."""
    from blockdraft.stages.generate.prompts import _prompt_from_row

    row = {"messages": [{"role": "assistant", "content": "Hello! Ask me anything."},
                        {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."},
                        {"role": "assistant", "content": "Anything else?"}, {"role": "user", "content": "No."},
                        {"role": "assistant", "content": "Bye."}]}
    assert _prompt_from_row(row, "r", "off", "all").rewrite == [2]  # and the final turn, after "No."
    assert _prompt_from_row(row, "r", "off", "last").rewrite == []


@pytest.mark.fault
def test_every_turn_ends_at_once_when_every_server_is_down(tmp_path):
    """turns = all over more conversations than one chunk, no server reachable: the run ends after one silence window,
    every conversation recorded failed (servers_down), not one window per chunk or round."""
    rows = [{"id": f"c{i:03d}", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"},
                                             {"role": "user", "content": "and?"}]} for i in range(150)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    said = Reporter()
    result = run(tmp_path / "p.jsonl", tmp_path / "o", openai_config(
        "http://127.0.0.1:9/v1", model="m", turns="all", timeout_s=1.0, servers_down_timeout_s=1.0), said)
    assert (result.details.failed, result.details.reasons) == (150, {"servers_down": 150})
    assert len(said.warnings) == 1 and said.warnings[0].startswith("no generate server answered for ")
    # the first chunk (64 conversations) was asked and failed at its first turn; the rest were never sent
    details = [json.loads(x)["detail"] for x in (tmp_path / "o" / FAILURES_NAME).read_text().splitlines()]
    assert sum(d.startswith("turn 1: no generate server answered") for d in details) == 64
    assert sum(d.startswith("no generate server answered") for d in details) == 150 - 64


@pytest.mark.fault
def test_a_fleet_that_serves_two_models_is_refused_before_any_request(tmp_path):
    write_prompts(tmp_path / "p.jsonl", 2)
    with ChatServer(TemplateChat()) as first, ChatServer(ToolChat()) as other:
        with pytest.raises(ConfigError, match=r"http://127\.0\.0\.1:\d+/v1 serves tool-chat, not template-chat: every "
                                              r"server of generate\.base_url must serve the target under one name"):
            run(tmp_path / "p.jsonl", tmp_path / "o", openai_config([first.url, other.url]))
        assert first.arrived() == other.arrived() == []


def test_a_group_is_one_rule_in_generate_and_tokenize():
    """A string or a whole number groups rows (the same text either way); anything else is the row's `bad_group`, in
    generate's prompt rows and tokenize's completion rows alike."""
    from blockdraft.data.completions import RowRejected, group_of, normalise
    from blockdraft.data.records import RawRecord
    from blockdraft.stages.generate.prompts import _prompt_from_row

    def row(group):
        return {"id": "r", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                "group": group}

    for good, text in (("prompt-7", "prompt-7"), (7, "7"), (None, None)):
        assert _prompt_from_row(row(good), "r", "off").group == text
        record = RawRecord(1, row(good), "")
        assert normalise(record).source_id == "r" and group_of(record) == text
    for bad in ("", True, 1.5, ["a"], {"g": 1}):
        with pytest.raises(RowRejected) as generate_refused:
            _prompt_from_row(row(bad), "r", "off")
        with pytest.raises(RowRejected) as tokenize_refused:
            normalise(RawRecord(1, row(bad), ""))
        assert generate_refused.value.reason == tokenize_refused.value.reason == "bad_group"
        assert repr(bad) in tokenize_refused.value.detail
