"""The Dockerfile agrees with the README's install steps and with the manifests (no container
daemon here: the image is not built, its text is checked)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from deploy.k8s_manifests import APP_DIR, CACHE_DIR, USER_ID

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _one(word: str) -> str:
    (value,) = [rest for w, rest in _instructions() if w == word]
    return value


def test_install_steps_are_the_readmes():
    readme_pin = re.search(
        r"pip install (torch==[\d.]+) && pip install -e \.", (ROOT / "README.md").read_text()
    )
    test_pin = re.search(
        r"pip install -q (torch==[\d.]+)", (ROOT / "scripts" / "test.sh").read_text()
    )
    assert readme_pin and test_pin and readme_pin.group(1) == test_pin.group(1)
    runs = " && ".join(rest for w, rest in _instructions() if w == "RUN")
    # The CPU wheel of the same pinned torch, then the project, in that order.
    torch_at = runs.index(f"--index-url https://download.pytorch.org/whl/cpu {readme_pin.group(1)}")
    assert torch_at < runs.index(
        'pip install --no-cache-dir -e ".[k8s]"'
    )  # + the autoscaler's client
    assert "python -m tinymodel" in runs  # the configs' `model = ""` is in the image


def test_image_layout_is_what_the_manifests_run():
    assert _one("WORKDIR") == APP_DIR
    assert _one("USER") == str(USER_ID)
    # The tiny model is baked in where the node pods' DUET_CACHE_DIR (and their packs) point.
    assert f"DUET_CACHE_DIR={CACHE_DIR} " in _one("ENV") + " "
    assert f"--uid {USER_ID}" in DOCKERFILE
    entrypoint = json.loads(_one("ENTRYPOINT"))
    assert entrypoint == [f"{APP_DIR}/deploy/launch_router.sh"]
    assert json.loads(_one("CMD")) == ["/etc/duet/config/cluster.toml"]
    commands = set()
    for path in (ROOT / "deploy" / "k8s" / "overlays").rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc.get("kind") in ("Deployment", "StatefulSet"):
                (container,) = doc["spec"]["template"]["spec"]["containers"]
                commands.add(container["command"][0])
    roles = ("router", "prefill", "decode", "join")  # join: the pools' joining nodes
    assert commands == {f"{APP_DIR}/deploy/launch_{r}.sh" for r in roles}
    for command in commands | set(entrypoint):
        script = ROOT / Path(command).relative_to(APP_DIR)
        assert script.is_file() and script.stat().st_mode & 0o111, script


def test_host_build_outputs_stay_out_of_the_image():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", "build", "**/*.so", "**/*.o"} <= set(ignored)
