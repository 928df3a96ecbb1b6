"""`duet plan`: the fit of a profile, packing nodes onto hosts, the choice among layouts, the
written cluster config, and a real profile of the tiny model."""

import json
import subprocess

import pytest

from control.cluster_config import ClusterConfig
from deploy import plan
from deploy.plan_profile import RoleProfile, ThreadProfile, decode_batches, prefill_lengths

# A synthetic machine: prefill a + b*new + c*new*prefix, decode a + b*batch + c*context.
PREFILL_TRUE = {1: (0.002, 4e-4, 1e-7), 2: (0.002, 2e-4, 5e-8)}
DECODE_TRUE = {1: (0.004, 1e-3, 2e-6), 2: (0.003, 6e-4, 1e-6)}


def synthetic_profile() -> RoleProfile:
    profile = RoleProfile("synthetic", 256, 16, 1024, 4096, 2)
    for threads in (1, 2):
        pa, pb, pc = PREFILL_TRUE[threads]
        da, db, dc = DECODE_TRUE[threads]
        samples = ThreadProfile()
        for new, prefix in ((256, 0), (256, 256), (64, 512), (16, 0), (128, 1024)):
            samples.prefill.append([new, prefix, pa + pb * new + pc * new * prefix])
        for batch in decode_batches(64):
            for ctx in (300, 150):
                samples.decode.append([batch, batch * ctx, da + db * batch + dc * batch * ctx])
        profile.by_threads[threads] = samples
    return profile


def test_fit_recovers_the_profiled_costs():
    fits = plan.fit(synthetic_profile())
    for threads in (1, 2):
        prefill, decode = fits[threads]
        assert prefill.model.weights == pytest.approx(PREFILL_TRUE[threads], rel=1e-3)
        assert decode.model.weights == pytest.approx(DECODE_TRUE[threads], rel=1e-3)


def test_profile_round_trips(tmp_path):
    profile = synthetic_profile()
    profile.save(tmp_path / "p.json")
    assert RoleProfile.load(tmp_path / "p.json") == profile
    (tmp_path / "bad.json").write_text(json.dumps({"version": 99}))
    with pytest.raises(Exception, match="profile version"):
        RoleProfile.load(tmp_path / "bad.json")


def test_nodes_pack_onto_hosts_first_fit():
    assert plan.fits_hosts([2, 2, 1, 1], hosts=2, cores_per_host=3)
    assert not plan.fits_hosts([2, 2, 2], hosts=2, cores_per_host=3)  # a node never spans hosts
    assert plan.fits_hosts([4], hosts=1, cores_per_host=4)
    assert not plan.fits_hosts([5], hosts=4, cores_per_host=4)


def test_thread_counts():
    assert plan.thread_counts("", 6) == [1, 2, 4, 6]
    assert plan.thread_counts("2,1", 4) == [1, 2]
    with pytest.raises(Exception, match="between 1"):
        plan.thread_counts("8", 4)


def test_profile_shapes_cover_prefix_and_batches():
    assert decode_batches(64) == [1, 2, 4, 8, 16, 32, 64]
    assert decode_batches(5) == [1, 2, 4, 5]
    assert max(prefill_lengths(512, 256)) == 512 and min(prefill_lengths(512, 256)) == 16


def run_plan(tmp_path, capsys, *extra):
    profile = tmp_path / "profile.json"
    synthetic_profile().save(profile)
    config = tmp_path / "cluster.toml"
    argv = ["--profile", str(profile), "--input-len", "512", "--output-len", "64",
            "--write-config", str(config), "--cores-per-host", "4", "--num-requests", "400",
            "--port", "9000", *extra]  # fmt: skip
    status = plan.main(argv)
    return status, capsys.readouterr(), config


def test_plan_recommends_the_cheapest_layout_that_meets_the_sla(tmp_path, capsys):
    # Prefill of 512 tokens: ~0.23 s on 1 thread; at 3 requests/s one node is ~70 % loaded.
    status, out, config = run_plan(
        tmp_path, capsys, "--rate", "3", "--sla-ttft-ms", "600", "--sla-tpot-ms", "60"
    )
    assert status == 0, out.err
    assert "# recommended:" in out.out and "bf16" in out.out
    cluster = ClusterConfig.load(config)
    assert cluster.sla.ttft_ms == 600 and cluster.sla.tpot_ms == 60
    rows = [line for line in out.out.splitlines() if line[:1].isdigit()]
    assert rows and "*" in rows[0]  # the first row is the chosen one and meets the target
    num_prefill, num_decode = int(rows[0][0]), int(rows[0][2])
    assert len(cluster.prefill) == num_prefill and len(cluster.decode) == num_decode
    # Every layout with fewer cores misses the target (else it would have been chosen).
    cores = sum(n.threads for n in (*cluster.prefill, *cluster.decode))
    for row in rows[1:]:
        fields = row.split()
        if int(fields[-11]) < cores:
            assert "*" not in fields[0] + fields[1]
    ports = [cluster.router.port, cluster.router.control_port]
    ports += [n.control_port for n in (*cluster.prefill, *cluster.decode)]
    ports += [n.kv_port for n in cluster.decode]
    assert sorted(ports) == list(range(9000, 9000 + len(ports)))  # one block, no clash


def test_plan_says_when_no_layout_meets_the_sla(tmp_path, capsys):
    # A TTFT target below one prompt's prefill time: nothing can meet it.
    status, out, config = run_plan(
        tmp_path, capsys, "--rate", "1", "--sla-ttft-ms", "50", "--sla-tpot-ms", "60"
    )
    assert status == 1
    assert "no layout" in out.err and not config.exists()


def test_plan_profiles_the_tiny_model(tmp_path, capsys, tiny_dir):
    saved = tmp_path / "tiny.json"
    argv = ["--model", str(tiny_dir), "--input-len", "48", "--output-len", "8",
            "--rate", "1", "--sla-ttft-ms", "5000", "--sla-tpot-ms", "1000", "--threads", "1",
            "--cores-per-host", "2", "--max-batch", "4", "--repeats", "1",
            "--num-requests", "200", "--save-profile", str(saved)]  # fmt: skip
    assert plan.main(argv) == 0
    profile = RoleProfile.load(saved)
    samples = profile.by_threads[1]
    assert {int(b) for b, _, _ in samples.decode} == {1, 2, 4}
    assert any(prefix > 0 for _, prefix, _ in samples.prefill)
    assert all(seconds > 0 for *_, seconds in samples.prefill + samples.decode)
    assert "1P1D" in capsys.readouterr().out


def test_a_colocated_profile_runs_the_other_role_beside_each(tmp_path, tiny_dir):
    """--colocated: each role is measured while `deploy.plan_neighbour` keeps the other busy;
    the neighbour is gone afterwards."""
    saved = tmp_path / "colocated.json"
    argv = ["--model", str(tiny_dir), "--input-len", "32", "--output-len", "4", "--rate", "1",
            "--sla-ttft-ms", "5000", "--sla-tpot-ms", "1000", "--threads", "1",
            "--cores-per-host", "2", "--max-batch", "2", "--repeats", "1", "--num-requests", "100",
            "--colocated", "--save-profile", str(saved)]  # fmt: skip
    assert plan.main(argv) == 0
    profile = RoleProfile.load(saved)
    assert profile.colocated and profile.by_threads[1].prefill and profile.by_threads[1].decode
    leftover = subprocess.run(["pgrep", "-f", "deploy.plan_neighbour"], capture_output=True)
    assert leftover.stdout.strip() == b""
