"""Loading the kernels built at install (kernels/cpu_ops.py): a module built from other sources or
for a CPU this one is not is refused, and a missing one falls back, each with one clear log line;
nothing is ever compiled."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from pagedserve.kernels import cpu_ops, extension_build


@pytest.fixture
def fresh_load():
    """cpu_ops.load() as on a fresh start (it decides once per process); restored after."""
    cpu_ops.load.cache_clear()
    yield cpu_ops.load
    cpu_ops.load.cache_clear()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_refusal_names_a_source_mismatch_and_missing_instruction_sets():
    built = SimpleNamespace(SOURCE_HASH="aaaa", BUILD_ISA="avx512f avx512_bf16", __file__="m.so")
    assert cpu_ops.refusal(built, "aaaa", {"avx512f", "avx512_bf16", "fma"}) is None
    assert "other sources (hash aaaa, csrc/ now bbbb)" in cpu_ops.refusal(
        built, "bbbb", {"avx512f", "avx512_bf16"})
    assert "['avx512_bf16']" in cpu_ops.refusal(built, "aaaa", {"avx512f"})


def test_a_build_of_other_sources_is_refused_with_one_message(fresh_load, monkeypatch, caplog):
    if fresh_load() is None:  # the shipped sources are accepted, where the kernels are built
        pytest.skip("the kernels are not built here (pip install --no-build-isolation -e .)")
    cpu_ops.load.cache_clear()
    monkeypatch.setattr(extension_build, "source_hash", lambda: "0123456789abcdef")
    with caplog.at_level(logging.INFO):
        assert fresh_load() is None
    [warning] = _warnings(caplog)
    assert "plain torch path: refused" in warning and "csrc/ now 0123456789abcdef" in warning
    assert cpu_ops.REBUILD_HINT in warning


def test_a_missing_build_falls_back_with_one_message(fresh_load, monkeypatch, caplog):
    monkeypatch.setattr(extension_build, "EXTENSION_NAME", "pagedserve.kernels._not_built")
    with caplog.at_level(logging.INFO):
        assert fresh_load() is None
    [warning] = _warnings(caplog)
    assert "plain torch path: the C++ CPU kernels are not built" in warning
    assert cpu_ops.REBUILD_HINT in warning


def test_source_hash_follows_every_source_and_header(tmp_path):
    (tmp_path / "a.cpp").write_text("int a;")
    (tmp_path / "b.h").write_text("int b;")
    before = extension_build.source_hash(tmp_path)
    (tmp_path / "b.h").write_text("int b2;")
    assert extension_build.source_hash(tmp_path) != before
    assert extension_build.source_files(tmp_path) == [tmp_path / "a.cpp"]


@pytest.mark.parametrize("cpu, wanted, unwanted", [
    ({"avx2", "fma", "f16c"}, {"-mavx2", "-mfma", "-mf16c"}, {"-mavx512f"}),  # AMD EPYC Zen 2
    ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"},
     {"-mavx2", "-mavx512f", "-mavx512bf16"}, {"-mavx512vnni"}),
    ({"avx2", "f16c"}, set(), {"-mavx2", "-mfma"}),  # no FMA: the baseline build
    ({"avx512f", "avx512bw", "avx512vl", "avx512dq"}, set(), {"-mavx512f"}),  # never without AVX2
])
def test_compile_flags_follow_the_building_cpu(cpu, wanted, unwanted):
    flags = extension_build.compile_flags(cpu)
    assert wanted <= set(flags) and not unwanted & set(flags)
    # The loader needs the running CPU to have each set the build used, and nothing else.
    assert extension_build.required_cpu_flags(flags) <= cpu
