"""On-demand decode KV with preemption through the real prefill and decode loops (in-process,
tiny model, deterministic stepping): a decode pool that holds every request's prompt and
headroom but not their whole outputs preempts, each preempted request is re-prefilled the way
the router does it (prompt + output so far, the tokens still to come), and every request ends
with the offline generator's greedy output; the decode node's pages return to zero."""

from pd_harness import Pair

from control.sampling_params import SamplingParams
from runtime.generate import OfflineGenerator

PROMPTS = [[3, 44, 18, 250, 9, 71, 130, 5], [100, 200, 300, 17, 23, 99], [7, 8, 9, 10]]
MAX_NEW = 14


def greedy(max_new):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)


class MiniRouter:
    """What router.recovery does on Preempted: a new attempt (wire id `id~n`) that prefills the
    prompt and the output so far and generates what is left; refused reservations retried."""

    def __init__(self, pair: Pair):
        self.pair = pair
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.attempt: dict[str, int] = {}
        self.waiting: list[str] = []  # preempted, to submit again
        self.num_preemptions = 0

    def wire_id(self, rid):
        return rid if self.attempt[rid] == 0 else f"{rid}~{self.attempt[rid]}"

    def submit(self, rid, prompt) -> bool:
        self.prompts[rid] = prompt
        self.outputs.setdefault(rid, [])
        self.attempt.setdefault(rid, 0)
        left = MAX_NEW - len(self.outputs[rid])
        return self.pair.submit(self.wire_id(rid), prompt + self.outputs[rid], greedy(left)).ok

    def step(self) -> None:
        self.pair.step()
        for rid in list(self.attempt):
            seen = self.pair.seen.get(self.wire_id(rid))
            if seen is not None and seen.preempted is not None and rid not in self.waiting:
                self.outputs[rid] += seen.output
                self.attempt[rid] += 1
                self.waiting.append(rid)
                self.num_preemptions += 1
        for rid in list(self.waiting):
            if self.submit(rid, self.prompts[rid]):
                self.waiting.remove(rid)

    def done(self, rid) -> bool:
        seen = self.pair.seen.get(self.wire_id(rid))
        return rid not in self.waiting and seen is not None and seen.finish_reason is not None

    def output(self, rid) -> list[int]:
        return self.outputs[rid] + self.pair.seen[self.wire_id(rid)].output


def test_preempted_requests_are_re_prefilled_and_match_offline_greedy(model32):
    expected = {
        f"r{i}": OfflineGenerator(model32).generate(p, greedy(MAX_NEW)).token_ids
        for i, p in enumerate(PROMPTS)
    }
    # Pages of 5 tokens, 2 tokens of headroom: 2 pages each up front (the pool's 6), 4 or 5
    # each to finish. All three are reserved before any KV arrives, so they share the pool and
    # preemption is certain (the first page any of them needs is one the pool does not have).
    pair = Pair(model32, d_page_size=5, d_num_pages=6, kv_headroom_tokens=2)
    router = MiniRouter(pair)
    try:
        for i, prompt in enumerate(PROMPTS):
            assert router.submit(f"r{i}", prompt)
        assert pair.decode_pages_used == 6
        rids = list(expected)
        for _ in range(2000):  # bounded: each step makes progress
            if all(router.done(rid) for rid in rids):
                break
            router.step()
        for rid in rids:
            errors = [e for s in pair.seen.values() for e in s.errors]
            assert router.done(rid) and not errors, (rid, errors)
            assert router.output(rid) == expected[rid], rid
        assert router.num_preemptions > 0
        assert pair.decode.scheduler.num_preempted == router.num_preemptions
        pair.settle()
        assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0
        assert pair.heartbeats and pair.heartbeats[-1].num_preempted == router.num_preemptions
    finally:
        pair.close()
