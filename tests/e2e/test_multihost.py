"""Across hosts, emulated on one machine: the router, two prefill nodes and a two-rank decode
node, each in its own network namespace (`netns_helpers.NetnsLab`: one private address each on a
bridge; this process, in the root namespace, holds the bridge's address), each started with its
own `deploy/launch_*.sh` on one shared cluster TOML that names those addresses. The official
openai client drives the router from the root namespace.

A role that binds or advertises an address its peers cannot reach fails here: every namespace
has its own loopback, so an endpoint naming 127.0.0.1 or 0.0.0.0 leads back into the peer's own
namespace. Two clusters:
- "curve": the CURVE key pair `duet keygen` wrote; the router, prefill-0 and the decode node
  bind every interface (`bind_host = "0.0.0.0"`), so they must advertise their `host` (the
  decode node for rank 1's KV receiver too, bound at a free port); prefill-1 binds its address;
- "insecure": `insecure = true`, every role binds its own address only.
In both, greedy outputs equal `duet generate` (float32), concurrent streams use both prefill
nodes and both decode ranks, no role listens anywhere but on the addresses the config gives it
(no loopback; the decode ranks' gloo group on the node's address), and SIGINT stops every role
with exit status 0 and nothing left in any namespace. Skipped where namespaces cannot be made
(no CAP_NET_ADMIN)."""

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from e2e_helpers import generate_reference
from netns_helpers import NetnsLab, NetnsUnavailable, listening_addresses

from deploy.local_cluster import dump_toml
from tinymodel.make import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[2]
ROLES = ["router", "prefill-0", "prefill-1", "decode"]
# The roles that bind every interface (bind_host = "0.0.0.0"), by variant; the others bind host.
WILDCARD_BOUND = {"curve": {"router", "prefill-0", "decode"}, "insecure": set()}
HTTP_PORT = 8000
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
MAX_NEW = 12
PROMPTS = ["Hello world", "The quick brown fox"]


def _config(lab: NetnsLab, wildcard: set[str], security: str) -> str:
    """The cluster TOML every role reads (each namespace has its own ports, so the defaults
    serve; the decode node's two ranks share its namespace)."""
    addr = lab.addresses

    def bind(name: str) -> dict:
        return {"bind_host": "0.0.0.0"} if name in wildcard else {}

    raw = {
        "model": str(ensure_tiny_model()),
        "dtype": "float32",
        "router": {"host": addr["router"], **bind("router"), "port": HTTP_PORT},
        "timeouts": {"node_timeout_s": 30.0},
        "prefill": [{"name": n, "host": addr[n], **bind(n)} for n in ("prefill-0", "prefill-1")],
        "decode": [{"name": "decode", "host": addr["decode"], **bind("decode"), "ranks": 2}],
    }
    return dump_toml(raw) + "\n" + security


def _keygen(out_dir: Path) -> str:
    """`duet keygen DIR`; the [security] lines it prints for the cluster config."""
    cmd = [sys.executable, "-m", "deploy.cli", "keygen", str(out_dir)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
    lines = [line for line in r.stdout.splitlines() if not line.startswith("#")]
    assert lines[0] == "[security]" and lines[1].startswith("curve_key_file = ")
    return "\n".join(lines) + "\n"


class Roles:
    """Every role of the cluster, each started in its namespace by its launch script."""

    def __init__(self, lab: NetnsLab, config: Path, log_dir: Path, wildcard: set[str]):
        self.lab, self.config, self.log_dir, self.wildcard = lab, config, log_dir, wildcard
        self.procs: dict[str, subprocess.Popen] = {}
        env = {**os.environ, "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1"}
        for name in ROLES:
            script = ROOT / "deploy" / f"launch_{name.split('-')[0]}.sh"
            cmd = ["bash", str(script), str(config), *([] if name == "router" else [name])]
            with open(log_dir / f"{name}.log", "w") as log:
                self.procs[name] = subprocess.Popen(
                    [*lab.exec_prefix(name), *cmd],
                    cwd=ROOT,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        self.url = f"http://{lab.addresses['router']}:{HTTP_PORT}"
        # No proxy from the environment: the traffic stays on the lab's bridge.
        self.http = httpx.Client(base_url=self.url, trust_env=False, timeout=10)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"---- {n}\n{self.log(n)[-3000:]}" for n in ROLES)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        body = None
        while time.monotonic() < deadline:
            exited = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            if exited:
                pytest.fail(f"{exited} exited while starting:\n{self.logs()}")
            try:
                body = self.http.get("/health", timeout=2).json()
            except (httpx.HTTPError, ValueError):
                body = None
            nodes = (body or {}).get("nodes", {})
            if len(nodes) == 3 and all(s.get("status") == "ready" for s in nodes.values()):
                return
            time.sleep(0.2)
        pytest.fail(f"not ready in {READY_TIMEOUT_S:g} s (health {body}):\n{self.logs()}")

    def client(self) -> openai.OpenAI:
        http = httpx.Client(trust_env=False)
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60, http_client=http
        )

    def async_client(self) -> openai.AsyncOpenAI:
        http = httpx.AsyncClient(trust_env=False)
        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60, http_client=http
        )

    def metric(self, name: str, **labels: str) -> float:
        want = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
        for line in self.http.get("/metrics").text.splitlines():
            sample, _, value = line.rpartition(" ")
            if sample == want:
                return float(value)
        return 0.0


@pytest.fixture(scope="module", params=["curve", "insecure"])
def cluster(request, tmp_path_factory):
    try:
        lab = NetnsLab.create(ROLES)
    except NetnsUnavailable as exc:
        pytest.skip(f"cannot create network namespaces: {exc}")
    roles = None
    try:
        tmp = tmp_path_factory.mktemp(request.param)
        if request.param == "curve":
            security = _keygen(tmp / "keys")
        else:
            security = "[security]\ninsecure = true\n"
        wildcard = WILDCARD_BOUND[request.param]
        config = tmp / "cluster.toml"
        config.write_text(_config(lab, wildcard, security))
        roles = Roles(lab, config, tmp, wildcard)
        roles.wait_ready()
        yield roles
    finally:  # SIGKILL to whatever still runs (the launched roles, decode rank 1), then unmake
        for proc in roles.procs.values() if roles is not None else ():
            proc.kill()
        lab.close()
        for proc in roles.procs.values() if roles is not None else ():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


@pytest.fixture(scope="module")
def references():
    return {p: generate_reference("float32", MAX_NEW, prompt=p) for p in PROMPTS}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completions_match_duet_generate(cluster, references, prompt):
    c = cluster.client()
    out = c.completions.create(model="tiny-model", prompt=prompt, max_tokens=MAX_NEW, temperature=0)
    assert out.choices[0].text == references[prompt]["text"]
    stream = c.completions.create(
        model="tiny-model", prompt=prompt, max_tokens=MAX_NEW, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stream) == references[prompt]["text"]


def test_concurrent_streams_use_every_node_and_rank(cluster, references):
    """8 streams at once: both prefill nodes serve some, and the decode node spreads them over
    both ranks (checked at stop, from its log): rank 1's KV receiver, bound on every interface
    at a free port, was reached at the address it advertised."""
    prompts = [PROMPTS[i % 2] for i in range(8)]

    async def one(c, prompt):
        stream = await c.completions.create(
            model="tiny-model", prompt=prompt, max_tokens=MAX_NEW, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run_all():
        c = cluster.async_client()
        return await asyncio.wait_for(asyncio.gather(*(one(c, p) for p in prompts)), 60)

    served = lambda n: cluster.metric("duet_node_requests_total", node=n, role="prefill")  # noqa: E731
    before = {n: served(n) for n in ("prefill-0", "prefill-1")}
    texts = asyncio.run(run_all())
    assert texts == [references[p]["text"] for p in prompts]
    assert all(served(n) > before[n] for n in before), {n: served(n) - before[n] for n in before}


def test_no_role_listens_beyond_its_addresses(cluster):
    """Read in each role's namespace: every listening socket is on the role's `host` or, where
    the config says so, on 0.0.0.0; none on loopback. The decode namespace holds its control
    socket, both ranks' KV receivers and the ranks' group (store + gloo), on the node's
    address or the wildcard."""
    lab = cluster.lab
    for name in ROLES:
        pid = cluster.procs[name].pid
        allowed = {lab.addresses[name]} | ({"0.0.0.0"} if name in cluster.wildcard else set())
        listening = listening_addresses(pid)
        assert listening, f"{name}: no listening socket found in its namespace"
        wrong = {(a, p) for a, p in listening if a not in allowed}
        assert not wrong, f"{name} listens on {sorted(wrong)}; allowed {sorted(allowed)}"
    decode = listening_addresses(cluster.procs["decode"].pid)
    # control + 2 KV receivers, the store and gloo's pair listeners
    assert len(decode) >= 4, sorted(decode)
    assert any(a == lab.addresses["decode"] for a, _ in decode), sorted(decode)
    # rank 1's KV receiver (a free port, bound like the node) advertises the node's host
    kv = re.search(r"rank 1 ready: .* KV (\S+)", cluster.log("decode")).group(1)
    assert kv.startswith(f"tcp://{lab.addresses['decode']}:"), kv


def test_sigint_stops_every_role_and_leaves_nothing(cluster):
    for name in ROLES:
        cluster.procs[name].send_signal(signal.SIGINT)
    codes = {}
    for name, proc in cluster.procs.items():
        try:
            codes[name] = proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            codes[name] = "hung"
    assert codes == dict.fromkeys(ROLES, 0), f"{codes}\n{cluster.logs()}"
    left = {name: cluster.lab.pids(name) for name in ROLES}
    assert not any(left.values()), left
    reserved = dict(re.findall(r"rank (\d): (\d+) requests reserved here", cluster.log("decode")))
    assert set(reserved) == {"0", "1"} and all(int(n) > 0 for n in reserved.values()), reserved
