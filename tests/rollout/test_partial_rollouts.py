"""Partial rollouts (--partial-rollouts). The turns a host's generations and weight syncs take (`EngineTurns`, real
threads): a sync waits for a generation that does not step aside, and runs while one that does is parked, which then
resumes with the new version; a generation waits for another and for a sync. A real fp32 vLLM engine's resumable
generation: uninterrupted, it samples what `generate` does (the same seeds); interrupted by a sync after a few decode
steps that installs other weights (or restarts the engine with them, as a sync that finds it dead does), it resumes
every unfinished sample on them, and every token's log-prob equals transformers' under the weights its recorded
version names (model A before the sync, B after) — no token mixes weights — while the resumed tokens' log-probs under
A do not."""
import collections
import threading

import pytest
import torch

from conftest import make_model_dir
from distributed import spawn

PROMPTS = [[5, 17, 42, 99], [7, 8, 9], [120, 3, 44, 250, 61]]
SAMPLES, MAX_NEW_TOKENS = 2, 24


class Timeline(threading.Condition):
    """The engine turns' condition, watched: what each named thread did (`record`) and how often it has begun to
    wait on the condition, so a test orders its threads by what they did rather than by sleeps or wake-up order."""

    def __init__(self):
        super().__init__()
        self.events, self.waits = [], collections.Counter()
        self._seen = threading.Condition()

    def wait(self, timeout=None):
        with self._seen:
            self.waits[threading.current_thread().name] += 1
            self._seen.notify_all()
        return super().wait(timeout)

    def record(self, event: str):
        with self._seen:
            self.events.append(event)
            self._seen.notify_all()

    def until(self, what, predicate):
        with self._seen:
            assert self._seen.wait_for(predicate, timeout=10), f"timed out waiting until {what}: {self.events}"


def _watched_turns():
    from megatron_ais.engine.turns import EngineTurns

    turns = EngineTurns()
    turns._changed = Timeline()
    return turns, turns._changed


def _run(target, name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def _generation_until(turns, timeline, release: threading.Event):
    def generation():
        with turns.generation():
            timeline.record("generation holds")
            release.wait(10)
            timeline.record("generation ends")
    return generation


def _sync(turns, timeline, release: threading.Event | None = None):
    def sync():
        with turns.sync():
            timeline.record("sync")
            turns.weights_version = 7
            if release is not None:
                release.wait(10)
            timeline.record("sync ends")
    return sync


def test_a_sync_waits_for_a_generation_that_does_not_step_aside():
    turns, timeline = _watched_turns()
    release = threading.Event()
    first = _run(_generation_until(turns, timeline, release), "generation")
    timeline.until("the generation holds the engine", lambda: "generation holds" in timeline.events)
    syncing = _run(_sync(turns, timeline), "sync")
    timeline.until("the sync waits (or runs)", lambda: timeline.waits["sync"] or "sync" in timeline.events)
    timeline.record("released")
    release.set()
    first.join(10), syncing.join(10)
    assert timeline.events == ["generation holds", "released", "generation ends", "sync", "sync ends"]


def test_a_sync_runs_while_the_generation_is_parked_and_it_resumes_on_the_new_weights():
    turns, timeline = _watched_turns()
    parked_with = []

    def generation_that_steps_aside():
        with turns.generation():
            timeline.record("generation holds")
            timeline.until("a sync asks", turns.sync_asked)
            timeline.record("parks")
            parked_with.append(turns.park())
            timeline.record("resumes")

    generating = _run(generation_that_steps_aside, "generation")
    timeline.until("the generation holds the engine", lambda: "generation holds" in timeline.events)
    syncing = _run(_sync(turns, timeline), "sync")
    syncing.join(10), generating.join(10)
    assert timeline.events == ["generation holds", "parks", "sync", "sync ends", "resumes"] and parked_with == [7]


def test_a_generation_waits_for_a_sync_that_asked_before_it():
    """The second generation asks for the engine after the sync did, while the first holds it: when the first ends,
    the sync runs and the second waits for it to end, whichever thread the condition wakes first."""
    turns, timeline = _watched_turns()
    release_first, release_sync = threading.Event(), threading.Event()
    first = _run(_generation_until(turns, timeline, release_first), "first")
    timeline.until("the first generation holds the engine", lambda: "generation holds" in timeline.events)
    syncing = _run(_sync(turns, timeline, release_sync), "sync")
    timeline.until("the sync waits", lambda: timeline.waits["sync"] == 1)

    def second_generation():
        with turns.generation():
            timeline.record("second generation")

    second = _run(second_generation, "second")
    timeline.until("the second generation waits", lambda: timeline.waits["second"] == 1)
    release_first.set()
    timeline.until("the sync holds the engine", lambda: "sync" in timeline.events)
    timeline.until("the second generation waits again, or runs",
                   lambda: timeline.waits["second"] == 2 or "second generation" in timeline.events)
    assert "second generation" not in timeline.events, "a generation ran during a weight sync"
    release_sync.set()
    for thread in (first, syncing, second):
        thread.join(10)
    assert timeline.events == ["generation holds", "generation ends", "sync", "sync ends", "second generation"]


def _weights(model_dir):
    from safetensors.torch import load_file
    import glob

    return [(name, t.float()) for path in sorted(glob.glob(f"{model_dir}/*.safetensors"))
            for name, t in load_file(path).items()]


def _worker(a_dir, b_dir, work):
    from megatron_ais.engine.vllm_engine import RolloutEngine, SamplingConfig
    from megatron_ais.engine.config import EngineConfig
    from megatron_ais.engine.turns import EngineTurns

    engine = RolloutEngine(EngineConfig(model_dir=a_dir, precision="fp32", kv_cache_gb=0.25,
                                        placement="colocated"), work)
    sampling = SamplingConfig(n=SAMPLES, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=11)
    whole = engine.generate(PROMPTS, sampling)
    uninterrupted = engine.generate(PROMPTS, sampling, turns=EngineTurns())

    class SyncAfterSteps(EngineTurns):
        """A sync asked after `steps` decode steps: it installs B's weights while the generation is parked (an
        engine in this process: the sync's work runs in `park`)."""

        def __init__(self, steps: int):
            super().__init__()
            self.polls, self.steps = 0, steps

        def sync_asked(self) -> bool:
            self.polls += 1
            return self.polls == self.steps

        def park(self) -> int:
            engine.update_weights(_weights(b_dir))
            self.weights_version = 1
            return self.weights_version

    class RestartAfterSteps(SyncAfterSteps):
        """The engine found dead by that sync: restarted with B's weights (a new vLLM engine)."""

        def park(self) -> int:
            engine.restart(_weights(b_dir))
            self.weights_version = 1
            return self.weights_version

    interrupted = engine.generate(PROMPTS, sampling, turns=SyncAfterSteps(6))
    engine.update_weights(_weights(a_dir))
    restarted = engine.generate(PROMPTS, sampling, turns=RestartAfterSteps(6))
    engine.shutdown()
    as_lists = [[(r.prompt_index, r.token_ids, r.logprobs, r.finish_reason, r.versions) for r in rollouts]
                for rollouts in (whole, uninterrupted, interrupted, restarted)]
    return as_lists


def _logprobs(model, prompt, tokens) -> list[float]:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


@pytest.mark.slow
def test_an_interrupted_generation_resumes_on_the_new_weights_and_records_each_tokens_version(model_root, tmp_path):
    from transformers import AutoModelForCausalLM

    shape = dict(hidden_size=128, intermediate_size=256)  # vLLM's CPU attention needs head_dim >= 32
    a_dir, b_dir = (make_model_dir(model_root, "qwen3", seed=seed, **shape) for seed in (1, 2))
    ((whole, uninterrupted, interrupted, restarted),) = spawn(1, _worker, a_dir, b_dir, str(tmp_path))
    # not interrupted: the same samples as vLLM's own n-sample requests, every token of version 0
    assert [r[:2] + r[3:4] for r in uninterrupted] == [r[:2] + r[3:4] for r in whole]
    assert max(abs(x - y) for a, b in zip(whole, uninterrupted) for x, y in zip(a[2], b[2])) <= 1e-6
    assert all(set(r[4]) == {0} for r in uninterrupted)

    models = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32) for d in (a_dir, b_dir)]
    for resumed in (interrupted, restarted):  # on the engine that installed B, or on the one restarted with B
        _check_resumed_on_b(resumed, models)


def _check_resumed_on_b(interrupted, models):
    assert len(interrupted) == len(PROMPTS) * SAMPLES
    partial, resumed_tokens, diffs, under_a = 0, 0, [], []
    for index, tokens, logprobs, reason, versions in interrupted:
        assert len(tokens) == len(logprobs) == len(versions) and 0 < len(tokens) <= MAX_NEW_TOKENS
        assert reason in ("stop", "length") and versions == sorted(versions) and set(versions) <= {0, 1}
        partial += len(set(versions)) > 1
        resumed_tokens += versions.count(1)
        by_version = [_logprobs(m, PROMPTS[index], tokens) for m in models]
        diffs += [abs(logprob - by_version[v][i]) for i, (logprob, v) in enumerate(zip(logprobs, versions))]
        under_a += [abs(logprob - by_version[0][i]) for i, (logprob, v) in enumerate(zip(logprobs, versions))
                    if v == 1]
    # the sync came after 5 decode steps: every sample still going then was resumed
    assert partial == sum(len(r[1]) > 5 for r in interrupted) > 0
    assert resumed_tokens > 20
    assert max(diffs) <= 1e-5, f"a token's log-prob is not its version's: max |engine - transformers| {max(diffs):.2e}"
    assert sum(under_a) / len(under_a) > 0.1, "the resumed tokens must be those of B's weights, not A's"
