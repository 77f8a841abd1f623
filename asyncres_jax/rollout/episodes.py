"""The episode runner: a batch of multi-turn terminal episodes played together by one policy.

Each turn, the policy writes one reply for every live episode in a single call (for a model: one batched
generation), the commands of that turn run in their sandboxes in parallel, and episodes that ended leave the
batch (and are graded and torn down at once, while the rest play on). The protocol is in protocol.py.

An episode ends when the policy says done, after `max_turns` replies, or when its wall-clock budget runs out;
a timed-out episode scores 0 and is not graded (as in the paper). Its clock starts once its sandbox is up.
"""

from __future__ import annotations

import abc
import concurrent.futures as cf
import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from asyncres_jax.envs.sandbox import OUTPUT_CAP, Backend, Grade, Sandbox, SandboxStartError
from asyncres_jax.errors import UserError
from asyncres_jax.rollout import cancel, protocol

if TYPE_CHECKING:
    from asyncres_jax.envs.task import Task

Message = dict[str, str]


@dataclasses.dataclass(frozen=True)
class EpisodeConfig:
    max_turns: int = 16  # replies per episode
    max_new_tokens: int = 2048  # tokens generated per reply at most
    context_limit: int = 16384  # rolling context of the generation engine, in tokens
    episode_timeout_s: float = 300.0  # wall clock per episode; a timed-out episode scores 0, ungraded
    command_timeout_s: float = 30.0  # one command's limit; its process tree is killed after it
    output_cap: int = OUTPUT_CAP  # characters of command output an observation keeps
    temperature: float = 0.6
    top_p: float = 1.0
    max_workers: int = 16  # threads starting sandboxes, running commands and grading at once
    first_reply_prefix: str = ""  # text the first reply starts with, put in the prompt (ModelPolicy)
    command_per_line: bool = False  # the one-command-per-line scaffold for small models (ModelPolicy)
    start_retries: int = 2  # more tries for a sandbox that fails to start; then the episode is an error
    reward_key: str = ""  # the verifier's metric (reward.json key) taken as the reward; "": its default
    system_prompt: str = "full"  # protocol.SYSTEM_PROMPTS: "full" (the protocol's rules), "compact" or "short"

    def __post_init__(self):
        for name in ("max_turns", "max_new_tokens", "context_limit", "output_cap", "max_workers"):
            if getattr(self, name) <= 0:
                raise UserError(f"episode {name}={getattr(self, name)} is not valid; it must be > 0")
        for name in ("episode_timeout_s", "command_timeout_s"):
            if not getattr(self, name) > 0:
                raise UserError(f"episode {name}={getattr(self, name)} is not valid; it must be > 0 seconds")
        if self.start_retries < 0:
            raise UserError(f"episode start_retries={self.start_retries} is not valid; it must be >= 0")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise UserError(
                f"episode sampling temperature={self.temperature}, top_p={self.top_p} is not valid; "
                "use temperature >= 0 and 0 < top_p <= 1"
            )
        if self.system_prompt not in protocol.SYSTEM_PROMPTS:
            raise UserError(f"episode system_prompt={self.system_prompt!r} is not one of "
                            f"{', '.join(protocol.SYSTEM_PROMPTS)}")

    @classmethod
    def from_sections(cls, episode: Any, sandbox: Any = None) -> "EpisodeConfig":
        """Build from the run config's `episode` (and optionally `sandbox`) sections (asyncres_jax.config)."""
        kw = {f.name: getattr(episode, f.name) for f in dataclasses.fields(cls) if hasattr(episode, f.name)}
        if sandbox is not None and hasattr(sandbox, "max_parallel"):
            kw["max_workers"] = sandbox.max_parallel
        return cls(**kw)


@dataclasses.dataclass(frozen=True)
class TokenState:
    """One episode's conversation as the model saw it: what GRPO trains on."""

    ids: np.ndarray  # [T] int32 token ids
    generated_mask: np.ndarray  # [T] bool, True where the model generated the token
    logprobs: np.ndarray  # [T] float32 log-prob of each generated token under the sampling distribution (0 elsewhere)


# Where a batch's wall clock goes, on its critical path (the runner's thread): waiting for sandboxes to start,
# the policy's prefill and decode (engine work) and its host work (templating, tokenising, cache bookkeeping, the
# runner's own loop), waiting for the turn's commands, and the final wait for grading and teardown (split between
# the two in proportion to their work in that wait). Grading of an episode that ends early runs while the others
# play on, so only what is left of it when the last reply is in shows here. They add up to the batch's wall clock.
PHASES = ("sandbox_start", "prefill", "decode", "host", "commands", "grading", "teardown")
COUNTS = ("prefill_tokens", "prefill_slots", "decode_steps")  # the engine's, beside the phases


def add_phases(total: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    """total[k] += more[k] for every key of `more` (in place); returns total."""
    for k, v in more.items():
        total[k] = total.get(k, 0.0) + v
    return total


@dataclasses.dataclass(frozen=True)
class Timings:
    """Seconds, by the runner's clock. `generate` is the time of the batched policy calls the episode was in."""

    sandbox_start: float = 0.0
    generate: float = 0.0
    commands: float = 0.0
    grade: float = 0.0
    total: float = 0.0  # from the start of the episode's clock to the end of its grading


@dataclasses.dataclass(frozen=True)
class EpisodeResult:
    task_id: str
    reward: float  # 1.0 if the final-state tests pass, else 0.0 (0.0 when timed out)
    partial: float  # fraction of final-state tests that passed
    turns: int  # replies the policy wrote
    end: str  # "done" | "max_turns" | "timeout" | "error"
    graded: bool  # False for timed-out episodes: their tests are not run
    transcript: list[Message]  # system, task, then the replies, observations and nudges in order
    commands: list[str]  # the commands that ran, in order
    tokens: TokenState | None  # None for policies without a model (scripted)
    timings: Timings
    grade: Grade | None = None
    error: str | None = None  # the sandbox never started (after retries): not played, kept out of fitness

    @property
    def timed_out(self) -> bool:
        return self.end == "timeout"


def played(results: Sequence[EpisodeResult]) -> list[EpisodeResult]:
    """The episodes that ran: an episode whose sandbox could not start says nothing about the policy."""
    return [r for r in results if r.error is None]


def fitness_of(results: Sequence[EpisodeResult], fitness: str) -> float:
    """Mean reward (fitness "binary") or partial credit ("partial") of the episodes that ran. When none ran,
    SandboxStartError: the job fails and is re-issued (a bounded number of times) rather than scored 0."""
    ran = played(results)
    if not ran:
        why = results[0].error if results else "no episodes"
        raise SandboxStartError(f"none of the member's {len(results)} episodes could start: {why}")
    return float(np.mean([r.partial if fitness == "partial" else r.reward for r in ran]))


# ---------------------------------------------------------------------------------------------------- policies


class PolicyBatch(abc.ABC):
    """A policy playing one batch of episodes (rows 0..n-1, in the order of the tasks)."""

    @abc.abstractmethod
    def step(self, rows: Sequence[int], new_messages: Sequence[Sequence[Message]]) -> list[str]:
        """Write one reply for each live episode in `rows` (ascending; rows absent now have left for good).

        new_messages[k] are the messages added to row rows[k]'s conversation since its last reply (none on the
        first turn): an observation or the nudge, as user messages.
        """

    def token_states(self) -> dict[int, TokenState]:
        """After the last step: the token state of every row that has one (none for scripted policies)."""
        return {}

    def work(self) -> dict[str, float]:
        """Engine work so far (the generation engine's Conversation.stats: prefill/decode seconds and tokens);
        empty for policies without a model."""
        return {}


class Policy(abc.ABC):
    @abc.abstractmethod
    def begin(self, conversations: Sequence[Sequence[Message]], seed: int) -> PolicyBatch:
        """Start a batch of episodes from their first messages (system prompt and task)."""


class ScriptedPolicy(Policy):
    """Replies from fixed scripts: each script entry becomes one reply; `<action>done</action>` once it runs out.

    With wrap=True (the default) entries are shell commands and are wrapped in <command> tags; with wrap=False
    they are whole replies, so tests can send malformed ones. One script for every episode, or one per episode.
    """

    def __init__(self, commands: Sequence[str] = (), *, scripts: Sequence[Sequence[str]] | None = None,
                 wrap: bool = True):
        if isinstance(commands, str):
            raise TypeError("commands is a list of strings, one per reply")
        self.commands, self.scripts, self.wrap = list(commands), scripts, wrap

    def reply(self, entry: str) -> str:
        return f"<command>{entry}</command>" if self.wrap else entry

    def begin(self, conversations, seed):
        if self.scripts is not None and len(self.scripts) != len(conversations):
            raise ValueError(f"{len(self.scripts)} scripts for {len(conversations)} episodes")
        scripts = [list(s) for s in self.scripts] if self.scripts is not None else [self.commands] * len(
            conversations)
        return _ScriptedBatch(self, scripts)


class _ScriptedBatch(PolicyBatch):
    def __init__(self, policy: ScriptedPolicy, scripts: list[list[str]]):
        self.policy, self.scripts, self.turn = policy, scripts, [0] * len(scripts)

    def step(self, rows, new_messages):
        replies = []
        for row in rows:
            script, t = self.scripts[row], self.turn[row]
            replies.append(self.policy.reply(script[t]) if t < len(script) else "<action>done</action>")
            self.turn[row] += 1
        return replies


class ModelPolicy(Policy):
    """A language model with given parameters, through the generation engine (asyncres_jax.model.generate).

    Each turn is one batched `engine.generate` over the live episodes; observations are appended with
    `engine.extend` (no re-prefill of the history; the engine keeps a rolling context), and episodes that ended
    leave the batch, their token state kept for the results.

    perturbation_fn is the hook for a low-rank population (rollout/cohort.py): given the episode indices in the batch,
    in batch order, it returns the engine's `perturbation` for those rows (e.g. each row's member and sign).
    It is called whenever the batch changes, so rows and perturbation always line up.

    first_reply_prefix (default none) is text the first reply starts with, put after the prompt instead of
    generated (e.g. "<command>"): it steers a small model that ignores the format into running a command once.
    It belongs to the prompt in the token state and is prepended to the first reply the parser sees.

    command_per_line is a scaffold for models too small to keep the tag format (SmolLM2-135M writes a command
    and then prose, never `</command>`): every reply starts with "<command>" in the prompt, generation stops at
    the end of the first line, and the harness closes the tag, so each reply is exactly one command; a line
    that says `done` (or `<action>done</action>`) ends the episode. The token state holds what the model saw
    and wrote (the prefix as prompt, the line and its newline as generated).
    """

    def __init__(self, engine, params, *, max_new_tokens: int = 2048, sampling: Any = None,
                 stop: Sequence[str] = protocol.STOP_STRINGS,
                 perturbation_fn: Callable[[list[int]], Any] | None = None, first_reply_prefix: str = "",
                 command_per_line: bool = False):
        self.engine, self.params, self.max_new_tokens = engine, params, max_new_tokens
        self.sampling, self.stop, self.perturbation_fn = sampling, tuple(stop), perturbation_fn
        self.command_per_line = command_per_line
        if command_per_line:
            self.stop = tuple(dict.fromkeys(self.stop + ("\n",)))
            first_reply_prefix = protocol.COMMAND_OPEN
        self.first_reply_prefix = first_reply_prefix

    @classmethod
    def from_config(cls, engine, params, cfg: EpisodeConfig, **kw) -> "ModelPolicy":
        from asyncres_jax.model.sampling import Sampling

        kw = {"first_reply_prefix": cfg.first_reply_prefix, "command_per_line": cfg.command_per_line, **kw}
        return cls(engine, params, max_new_tokens=cfg.max_new_tokens,
                   sampling=Sampling(temperature=cfg.temperature, top_p=cfg.top_p), **kw)

    def perturbation(self, rows: list[int]) -> Any:
        return None if self.perturbation_fn is None else self.perturbation_fn(list(rows))

    def begin(self, conversations, seed):
        rows, conversations = list(range(len(conversations))), [[dict(m) for m in c] for c in conversations]
        if not self.first_reply_prefix:
            conv = self.engine.start(self.params, conversations, seed, perturbation=self.perturbation(rows))
            return _ModelBatch(self, conv, rows)
        chat, encode = self.engine.model.chat_prompt, self.engine.encode
        prompts = [encode(chat(c) + self.first_reply_prefix) for c in conversations]
        conv = self.engine.start_tokens(self.params, prompts, seed, perturbation=self.perturbation(rows))
        for row, c in zip(conv.rows, conversations):  # so later observations are templated as chat messages
            row.messages = c
        return _ModelBatch(self, conv, rows, prefix=self.first_reply_prefix)


class _ModelBatch(PolicyBatch):
    """`conv` (the engine's conversation) and `rows` (the episode of each of its rows) are read by wrappers
    such as grpo.rollout.RecordingPolicy, which snapshot the token state after every reply."""

    def __init__(self, policy: ModelPolicy, conv: Any, rows: list[int], prefix: str = ""):
        self.policy, self.conv, self.rows = policy, conv, rows  # rows[k]: the episode in the batch's row k
        self.pert, self.states, self.prefix = policy.perturbation(rows), {}, prefix

    def _keep_states(self, positions: Sequence[int]) -> None:
        tokens, mask, logprobs = self.conv.tokens, self.conv.generated_mask, self.conv.logprobs
        for k in positions:
            self.states[self.rows[k]] = TokenState(ids=tokens[k], generated_mask=mask[k], logprobs=logprobs[k])

    def step(self, rows, new_messages):
        p, engine, rows = self.policy, self.policy.engine, list(rows)
        if rows != self.rows or any(new_messages):
            staying = dict(zip(rows, new_messages))
            self._keep_states([k for k, r in enumerate(self.rows) if r not in staying])
            # None: the row leaves the batch (its episode ended)
            self.conv = engine.extend(self.conv, [list(staying[r]) if r in staying else None for r in self.rows])
            if rows != self.rows:
                self.rows, self.pert = rows, p.perturbation(rows)
            if p.command_per_line:  # the next reply opens its command tag as prompt, like the first one
                opener = engine.encode(protocol.COMMAND_OPEN)
                self.conv = engine.extend_tokens(self.conv, [opener] * len(self.rows))
        self.conv, texts = engine.generate(p.params, self.conv, p.max_new_tokens, p.sampling, p.stop,
                                           perturbation=self.pert)
        prefix, self.prefix = self.prefix, ""
        if p.command_per_line:
            return [protocol.close_command_line(t) for t in texts]
        return [prefix + t for t in texts]

    def token_states(self):
        self._keep_states(range(len(self.rows)))
        return dict(self.states)

    def work(self):
        return dict(self.conv.stats)


# ---------------------------------------------------------------------------------------------------- the runner


@dataclasses.dataclass
class _Episode:
    task: Any
    transcript: list[Message]
    sandbox: Sandbox | None = None
    start_s: float = 0.0
    t0: float = 0.0
    turns: int = 0
    end: str | None = None
    pending: list[Message] = dataclasses.field(default_factory=list)
    commands: list[str] = dataclasses.field(default_factory=list)
    generate_s: float = 0.0
    commands_s: float = 0.0
    finish: cf.Future | None = None  # grade (unless timed out) + close, running in the pool

    def elapsed(self, clock: Callable[[], float]) -> float:
        return clock() - self.t0


def _start(backend: Backend, task, clock, retries: int) -> tuple[Sandbox | None, float, str | None]:
    """(sandbox, seconds, None), or (None, seconds, why) when every one of 1 + retries tries failed."""
    t = clock()
    for attempt in range(retries + 1):
        try:
            return backend.start(task), clock() - t, None
        except SandboxStartError as e:
            if attempt == retries:
                return None, clock() - t, str(e)
    raise AssertionError("unreachable")


def _grade_and_close(ep: _Episode, graded: bool, clock) -> tuple[Grade | None, float, float, float]:
    """Returns the grade (None when not graded), when grading started, when teardown started, and the end time."""
    t = clock()
    try:
        grade = ep.sandbox.grade() if graded else None
    finally:
        t_close = clock()
        ep.sandbox.close()
    return grade, t, t_close, clock()


def _overlap(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


def _claim_sandboxes(eps: list[_Episode], starts: list[cf.Future]) -> dict[int, str]:
    """Take each started sandbox into its episode, so that cleanup closes it; returns why, by row, for each
    episode whose sandbox never started (after its retries), marked ended by "error". A start that raised
    something else is re-raised once every start is accounted for."""
    errors, failed = [], {}
    for i, (ep, fut) in enumerate(zip(eps, starts)):
        try:
            ep.sandbox, ep.start_s, why = fut.result()
        except BaseException as e:
            errors.append(e)
            continue
        if why is not None:
            failed[i], ep.end = why, "error"
    if errors:
        raise errors[0]
    return failed


def _play_turn(batch: PolicyBatch, eps: list[_Episode], live: list[int], pool: cf.ThreadPoolExecutor,
               cfg: EpisodeConfig, clock) -> tuple[list[int], float]:
    """One turn: a reply for every live episode, their commands run in parallel, and the episodes that ended
    sent to grading and teardown. Returns the episodes still live and the seconds spent waiting for commands."""
    t = clock()
    replies = batch.step(live, [eps[i].pending for i in live])
    gen_s = clock() - t
    if len(replies) != len(live):
        raise RuntimeError(f"policy wrote {len(replies)} replies for {len(live)} live episodes")
    runs = []
    for i, reply in zip(live, replies):
        ep = eps[i]
        ep.pending, ep.generate_s, ep.turns = [], ep.generate_s + gen_s, ep.turns + 1
        ep.transcript.append({"role": "assistant", "content": reply})
        if ep.elapsed(clock) >= cfg.episode_timeout_s:
            ep.end = "timeout"
            continue
        parsed = protocol.parse_reply(reply)
        if parsed.kind == "done":
            ep.end = "done"
        elif parsed.kind == "command":
            timeout = min(cfg.command_timeout_s, cfg.episode_timeout_s - ep.elapsed(clock))
            ep.commands.append(parsed.command)
            runs.append((i, timeout, pool.submit(ep.sandbox.run, parsed.command, timeout)))
        else:
            ep.pending = [{"role": "user", "content": protocol.NUDGE}]
    t = clock()
    for i, timeout, fut in runs:
        ep, result = eps[i], fut.result()
        ep.commands_s += result.seconds
        ep.pending = [{"role": "user", "content": protocol.observation(result, timeout, cfg.output_cap)}]
        out_of_time = result.timed_out and timeout < cfg.command_timeout_s
        if out_of_time or ep.elapsed(clock) >= cfg.episode_timeout_s:
            ep.end = "timeout"
    commands_s = clock() - t
    for i in live:
        ep = eps[i]
        ep.transcript.extend(ep.pending)
        if ep.end is None and ep.turns >= cfg.max_turns:
            ep.end = "max_turns"
        if ep.end is not None:  # grade and tear down now, while the others play on
            ep.finish = pool.submit(_grade_and_close, ep, ep.end != "timeout", clock)
    return [i for i in live if eps[i].end is None], commands_s


def _final_phases(spent: dict[str, float], engine: dict[str, float], finished: list[tuple], t_begin: float,
                  t_last: float, t_done: float) -> dict[str, float]:
    """Fill in the batch's phases once the last reply is in (at t_last) and every episode is finished (t_done):
    the engine's prefill and decode, the final wait split between grading and teardown, and the rest as host."""
    spent["prefill"], spent["decode"] = engine.get("prefill_seconds", 0.0), engine.get("decode_seconds", 0.0)
    # the wait for the last grades and teardowns, split in proportion to their work during it
    grading = sum(_overlap(g0, c0, t_last, t_done) for _, g0, c0, _ in finished)
    teardown = sum(_overlap(c0, c1, t_last, t_done) for _, _, c0, c1 in finished)
    share = grading / (grading + teardown) if grading + teardown > 0 else 1.0
    spent["grading"], spent["teardown"] = share * (t_done - t_last), (1 - share) * (t_done - t_last)
    spent["host"] = max(0.0, t_done - t_begin - sum(spent.values()))  # all the rest of the batch's call
    return spent


def _results(eps: list[_Episode], finished: list[tuple], failed: dict[int, str],
             token_states: dict[int, TokenState], cfg: EpisodeConfig) -> list[EpisodeResult]:
    results = []
    for i, (ep, (grade, t_grade, _, t_end)) in enumerate(zip(eps, finished)):
        timings = Timings(
            sandbox_start=ep.start_s, generate=ep.generate_s, commands=ep.commands_s, grade=t_end - t_grade,
            total=t_end - ep.t0,
        )
        results.append(EpisodeResult(
            task_id=ep.task.name, reward=grade.metric(cfg.reward_key) if grade else 0.0,
            partial=float(grade.partial) if grade else 0.0, turns=ep.turns, end=ep.end,
            graded=grade is not None, transcript=ep.transcript, commands=ep.commands,
            tokens=token_states.get(i), timings=timings, grade=grade, error=failed.get(i),
        ))
    return results


def _close_all(pool: cf.ThreadPoolExecutor, eps: list[_Episode], starts: list[cf.Future]) -> None:
    """Cleanup on the way out. On success every sandbox was closed by its finish job. After an error: drop queued
    jobs, close each sandbox whose finish job never ran (this also kills commands still running in it), then wait."""
    pool.shutdown(wait=False, cancel_futures=True)
    for ep in eps:
        if ep.sandbox is not None and (ep.finish is None or ep.finish.cancelled()):
            try:
                ep.sandbox.close()
            except Exception:  # keep closing the others; an error is already propagating
                pass
    pool.shutdown(wait=True)
    for fut in starts:  # a start that finished after an interrupt left its sandbox unclaimed
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            sandbox = fut.result()[0]
            if sandbox is not None and all(ep.sandbox is not sandbox for ep in eps):
                sandbox.close()


def run_episodes(
    policy: Policy,
    tasks: Sequence["Task"],
    sandbox_backend: Backend,
    episode_cfg: EpisodeConfig = EpisodeConfig(),
    seed: int = 0,
    *,
    clock: Callable[[], float] = time.monotonic,
    work: dict[str, float] | None = None,
) -> list[EpisodeResult]:
    """Play one episode per task, all in one batch; results in the order of `tasks`.

    `clock` (seconds) decides the episode time limit and the timings; tests pass a fake one. Every sandbox this
    starts is closed before it returns or raises, including when the job is cancelled (rollout.cancel: checked
    at every turn boundary, raising Cancelled). `work`, when given, gets the batch's seconds per PHASES and the
    engine's token counts (prefill_tokens, prefill_slots, decode_steps) added.
    """
    cfg = episode_cfg
    if not tasks:
        return []
    t_begin, spent = clock(), dict.fromkeys(PHASES, 0.0)
    eps = [_Episode(task=t, transcript=protocol.first_messages(t.instruction, cfg.system_prompt)) for t in tasks]
    pool = cf.ThreadPoolExecutor(max_workers=min(len(eps), cfg.max_workers), thread_name_prefix="episode")
    starts: list[cf.Future] = []
    try:
        starts = [pool.submit(_start, sandbox_backend, ep.task, clock, cfg.start_retries) for ep in eps]
        failed = _claim_sandboxes(eps, starts)

        t0 = clock()
        spent["sandbox_start"] = t0 - t_begin
        batch = policy.begin([ep.transcript for ep in eps], seed)  # a model prefills the prompts here
        begin_s = clock() - t0
        for ep in eps:
            ep.t0, ep.generate_s = t0, begin_s
        live = [i for i in range(len(eps)) if i not in failed]
        while live:
            cancel.check("episode batch")  # a turn boundary: stop here if the pool cancelled the job
            live, commands_s = _play_turn(batch, eps, live, pool, cfg, clock)
            spent["commands"] += commands_s

        token_states = batch.token_states()
        t_last = clock()
        # an episode whose sandbox never started has no grade, and no time grading or tearing down
        finished = [ep.finish.result() if i not in failed else (None, ep.t0, ep.t0, ep.t0) for i, ep in enumerate(eps)]
        t_done = clock()
        if work is not None:
            engine = batch.work()
            add_phases(work, _final_phases(spent, engine, finished, t_begin, t_last, t_done))
            add_phases(work, {k: engine.get(k, 0) for k in COUNTS})
        return _results(eps, finished, failed, token_states, cfg)
    finally:
        _close_all(pool, eps, starts)


def format_transcript(result: EpisodeResult) -> str:
    """A readable transcript: each message under its role, then how the episode ended and its score."""
    lines = []
    for m in result.transcript:
        lines += [f"--- {m['role']}", m["content"]]
    score = (f"reward={result.reward:g} partial={result.partial:.2f}" if result.graded
             else f"not played: {result.error}" if result.error else "reward=0 (timed out, not graded)")
    lines.append(f"=== {result.task_id}: {result.end} after {result.turns} turns, {score}, "
                 f"{result.timings.total:.2f} s")
    return "\n".join(lines)
