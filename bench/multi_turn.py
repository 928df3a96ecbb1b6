"""The multi-turn workload of `duet bench-serve --dataset multi-turn`: conversations that each
send their turns one after another, every turn carrying the whole history.

`--num-prompts` conversations x `--turns` turns. Every conversation starts with the same system
prompt of `--prefix-len` tokens (the one a deployment puts first in every chat), then its user
turns of `--input-len` tokens each (random word tokens, `bench.datasets.PromptMaker`: exact
lengths, no accidental sharing) and answers of `--output-len` tokens. Turn k is sent as soon as
the answer of turn k-1 has arrived, with that answer (the text the server streamed) in its
history: the traffic of chat and agent sessions, where turn k+1 repeats all of turn k, and what
prefix caches and KV tiers are for. Conversations start on the Poisson arrivals of
`--request-rate` (inf: all at once); `--max-concurrency` bounds the requests in flight (a
conversation holds a slot only while one of its turns runs).

On the chat endpoint the history is messages (system, then user / assistant in turn); on the
completions endpoint it is their texts joined. Each turn is one `RequestRecord` with its
conversation and turn number, so the summary can tell the first turn (nothing to reuse) from the
later ones.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from bench.datasets import BenchRequest, PromptMaker
from bench.serve_metrics import RequestRecord
from control.errors import ConfigError


@dataclass(frozen=True)
class Conversation:
    system: BenchRequest  # the shared system prompt (its output_len is unused)
    turns: tuple[BenchRequest, ...]  # the user turns, each with the answer length asked


def make_conversations(
    tokenizer, num: int, turns: int, user_len: int, output_len: int, prefix_len: int, seed: int
) -> list[Conversation]:
    """`num` conversations of `turns` turns behind one system prompt of `prefix_len` tokens
    (deterministic in `seed`)."""
    if min(num, turns, user_len, output_len, prefix_len) < 1:
        raise ConfigError("conversations, turns, input, output and prefix lengths must be >= 1")
    maker = PromptMaker(tokenizer, seed)
    system = BenchRequest(maker.prompt(prefix_len), prefix_len, 0)
    return [
        Conversation(
            system,
            tuple(BenchRequest(maker.prompt(user_len), user_len, output_len) for _ in range(turns)),
        )
        for _ in range(num)
    ]


def turn_request(conv: Conversation, turn: int, answers: list[str], chat: bool) -> dict:
    """The body fields that carry turn `turn`'s prompt: its history (the system prompt, earlier
    user turns and the answers streamed to them) and the turn itself."""
    messages = [{"role": "system", "content": conv.system.prompt}]
    for k in range(turn):
        messages.append({"role": "user", "content": conv.turns[k].prompt})
        messages.append({"role": "assistant", "content": answers[k]})
    messages.append({"role": "user", "content": conv.turns[turn].prompt})
    if chat:
        return {"messages": messages}
    return {"prompt": "".join(m["content"] for m in messages)}


async def run_conversations(
    target,
    conversations: list[Conversation],
    rate: float,
    max_concurrency: int | None,
    seed: int,
    tokenizer,
    send_one,
    arrival_times,
) -> tuple[list[RequestRecord], float]:
    """Every conversation's turns in order; (records by conversation then turn, duration s).
    `send_one(client, target, index, request, t0, tokenizer, fields, text_out)` and
    `arrival_times(n, rate, seed)` are bench.serve's."""
    arrivals = arrival_times(len(conversations), rate, seed)
    num_turns = len(conversations[0].turns) if conversations else 0
    limit = max_concurrency or max(1, len(conversations))
    sem = asyncio.Semaphore(limit)
    timeout = httpx.Timeout(target.timeout_s, connect=min(10.0, target.timeout_s))
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    records: list[RequestRecord | None] = [None] * (len(conversations) * num_turns)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()

        async def converse(c: int) -> None:
            delay = t0 + arrivals[c] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            conv, answers = conversations[c], []
            for turn, user in enumerate(conv.turns):
                fields = turn_request(conv, turn, answers, target.chat)
                prompt_len = conv.system.prompt_len + sum(
                    t.prompt_len + t.output_len for t in conv.turns[:turn]
                )
                req = BenchRequest("", prompt_len + user.prompt_len, user.output_len)
                text: list[str] = []
                async with sem:
                    index = c * num_turns + turn
                    rec = await send_one(client, target, index, req, t0, tokenizer, fields, text)
                rec.conversation, rec.turn = c, turn + 1
                records[index] = rec
                if not rec.ok:  # the conversation cannot go on without its answer
                    break
                answers.append("".join(text))

        await asyncio.gather(*(converse(c) for c in range(len(conversations))))
        duration = time.perf_counter() - t0
    return [r for r in records if r is not None], duration
