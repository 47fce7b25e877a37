"""`fastdata convert imagefolder` and `fastdata info` through click's CliRunner."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from support import NUM_CLASSES, PER_CLASS, folder_listing, one_error_line, stored_images
from support import run_cli as run

from fastdata import errors
from fastdata.cli import main
from fastdata.codecs.images import RESAMPLE_FILTERS, RESIZE_MODES
from fastdata.converters.imagefolder import STORAGE_MODES
from fastdata.converters.report import ON_ERROR
from fastdata.converters.textsources import SOURCE_FORMATS
from fastdata.formats import read_packed

NUM_SAMPLES = NUM_CLASSES * PER_CLASS


@pytest.fixture
def bad_source(source_copy):
    (source_copy / "class_2" / "broken.jpg").write_bytes(b"\xff\xd8\xff definitely not a jpeg")
    return source_copy


# ---------------------------------------------------------------- convert


@pytest.mark.parametrize("ext", [".h5", ".arrow"])
def test_convert_writes_the_file_and_reports(source_root, tmp_path, ext):
    out = tmp_path / f"photos{ext}"
    result = run("convert", "imagefolder", source_root, out, "--size", "16", "--workers", "1", "--quiet")
    assert result.exit_code == 0, result.output
    assert out.is_file()
    assert f"{NUM_SAMPLES} samples" in result.output and "0 skipped" in result.output
    images, labels, metadata = stored_images(out)
    assert images.shape == (NUM_SAMPLES, 16, 16, 3)
    assert metadata["class_counts"] == [PER_CLASS] * NUM_CLASSES
    assert folder_listing(tmp_path) == [out.name]


def test_convert_passes_every_option(source_root, tmp_path):
    out = tmp_path / "photos.arrow"
    result = run(
        "convert", "imagefolder", source_root, out,
        "--size", "24x40", "--resize", "pad", "--resample", "nearest", "--storage", "jpeg",
        "--quality", "60", "--workers", "2", "--on-error", "raise", "--quiet",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    _, metadata = read_packed(out)
    assert metadata["sample_shape"] == [3, 24, 40]
    assert metadata["storage"] == "jpeg"
    prep = metadata["preprocessing"]
    assert (prep["resize"], prep["resample"], prep["quality"]) == ("pad", "nearest", 60)


def test_convert_reports_skipped_inputs(bad_source, tmp_path):
    result = run("convert", "imagefolder", bad_source, tmp_path / "out.h5", "--workers", "1", "--quiet")
    assert result.exit_code == 0, result.output
    assert "1 skipped" in result.output
    assert os.path.join("class_2", "broken.jpg") in result.output


def test_convert_with_the_default_progress_setting(source_root, tmp_path):
    # No --quiet: the progress bar is on (it draws nothing off a terminal) and warns about nothing.
    result = run("convert", "imagefolder", source_root, tmp_path / "out.h5", "--workers", "1")
    assert result.exit_code == 0, result.output
    assert f"{NUM_SAMPLES} samples" in result.output


def test_convert_overwrite(source_root, tmp_path):
    out = tmp_path / "out.h5"
    out.write_bytes(b"old")
    result = run("convert", "imagefolder", source_root, out, "--overwrite", "--quiet", "--workers", "1")
    assert result.exit_code == 0, result.output
    assert read_packed(out)[1]["num_samples"] == NUM_SAMPLES


# ---------------------------------------------------------------- convert errors


def test_missing_source_is_one_error_line(tmp_path):
    result = run("convert", "imagefolder", tmp_path / "nowhere", tmp_path / "out.h5", "--quiet")
    assert result.exit_code == 1
    assert "nowhere" in one_error_line(result)
    assert os.listdir(tmp_path) == []


def test_existing_output_is_one_error_line(source_root, tmp_path):
    out = tmp_path / "out.h5"
    out.write_bytes(b"keep me")
    result = run("convert", "imagefolder", source_root, out, "--quiet")
    assert result.exit_code == 1
    line = one_error_line(result)
    assert "already exists" in line and "--overwrite" in line
    assert out.read_bytes() == b"keep me"


@pytest.mark.parametrize("size", ["0", "abc", "12x", "3x4x5", "-4", "10x0"])
def test_bad_size_is_one_error_line(source_root, tmp_path, size):
    result = run("convert", "imagefolder", source_root, tmp_path / "out.h5", "--size", size, "--quiet")
    assert result.exit_code == 1, result.output
    assert "--size" in one_error_line(result)
    assert os.listdir(tmp_path) == []


def test_file_output_without_a_packed_extension_is_one_error_line(source_root, tmp_path):
    (tmp_path / "out.zip").write_bytes(b"keep me")  # OUT without .h5/.arrow is a shard folder, and this is a file
    result = run("convert", "imagefolder", source_root, tmp_path / "out.zip", "--quiet")
    assert result.exit_code == 1
    assert "extension" in one_error_line(result)
    assert (tmp_path / "out.zip").read_bytes() == b"keep me"


def test_empty_source_is_one_error_line(tmp_path):
    (tmp_path / "empty").mkdir()
    result = run("convert", "imagefolder", tmp_path / "empty", tmp_path / "out.h5", "--quiet")
    assert result.exit_code == 1
    assert "no class folders" in one_error_line(result)


def test_on_error_raise_names_the_file(bad_source, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    result = run(
        "convert", "imagefolder", bad_source, out_dir / "out.h5", "--on-error", "raise", "--workers", "2", "--quiet"
    )
    assert result.exit_code == 1
    assert os.path.join("class_2", "broken.jpg") in one_error_line(result)
    assert folder_listing(out_dir) == []


def test_debug_shows_the_traceback(tmp_path):
    result = run("convert", "imagefolder", tmp_path / "nowhere", tmp_path / "out.h5", "--quiet", "--debug")
    assert result.exit_code == 1
    assert "Traceback" in result.output and "SourceError" in result.output


SLOW_CLI_SCRIPT = textwrap.dedent(
    """
    import time

    from fastdata.converters import imagefolder

    _real_prepare = imagefolder._prepare_image


    def _slow_prepare(task, **kwargs):
        # Runs in the worker processes too (forked, or this module is their __main__).
        time.sleep(0.25)
        return _real_prepare(task, **kwargs)


    imagefolder._prepare_image = _slow_prepare

    if __name__ == "__main__":
        from fastdata.cli import main

        main()
    """
)


@pytest.mark.integration  # a subprocess killed, signalled or raced
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_during_conversion_leaves_nothing(source_root, tmp_path, signum):
    script = tmp_path / "slow_fastdata.py"
    script.write_text(SLOW_CLI_SCRIPT)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = [sys.executable, os.fspath(script), "convert", "imagefolder", os.fspath(source_root),
            os.fspath(out_dir / "out.h5"), "--workers", "2", "--quiet"]
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child:
        deadline = time.monotonic() + 60
        while not os.listdir(out_dir):  # wait for the staging folder: work has started
            assert child.poll() is None and time.monotonic() < deadline, "conversion did not start"
            time.sleep(0.02)
        assert os.listdir(out_dir)[0].startswith(".out.h5.")
        time.sleep(0.5)
        child.send_signal(signum)
        output, _ = child.communicate(timeout=60)
    assert child.returncode != 0, output
    if signum == signal.SIGTERM:
        assert child.returncode == 128 + signal.SIGTERM, output
    assert folder_listing(out_dir) == [], output


# ---------------------------------------------------------------- info


def test_info_describes_the_file(bad_source, tmp_path):
    out = tmp_path / "out.arrow"
    converted = run("convert", "imagefolder", bad_source, out, "--storage", "jpeg", "--quiet", "--workers", "1")
    assert converted.exit_code == 0
    _, metadata = read_packed(out)
    result = run("info", out)
    assert result.exit_code == 0, result.output
    text = result.output
    assert os.fspath(out) in text and "arrow" in text and "format version 2" in text
    assert f"samples:     {NUM_SAMPLES}" in text
    assert "stored as jpeg" in text
    assert f"classes:     {NUM_CLASSES}" in text
    for name in metadata["classes"]:
        assert any(line.split() == [str(PER_CLASS), name] for line in text.splitlines()), name
    assert str(metadata["mean"]) in text and str(metadata["std"]) in text
    assert "skipped:     1" in text
    assert os.path.join("class_2", "broken.jpg") in text
    assert "quality=90" in text and "resize=crop" in text


def test_info_lists_many_skipped_inputs_briefly(source_copy, tmp_path):
    for index in range(12):
        (source_copy / "class_0" / f"bad_{index:02d}.png").write_text("junk")
    out = tmp_path / "out.h5"
    assert run("convert", "imagefolder", source_copy, out, "--quiet", "--workers", "1").exit_code == 0
    text = run("info", out).output
    assert "skipped:     12" in text
    assert "bad_09.png" in text and "bad_10.png" not in text
    assert "... and 2 more" in text


def test_info_on_a_missing_file(tmp_path):
    result = run("info", tmp_path / "missing.h5")
    assert result.exit_code == 1
    assert "missing.h5" in one_error_line(result)


def test_info_on_a_foreign_file(tmp_path):
    path = tmp_path / "foreign.arrow"
    path.write_bytes(np.random.default_rng(0).bytes(1000))
    result = run("info", path)
    assert result.exit_code == 1
    assert "foreign.arrow" in one_error_line(result)


# ---------------------------------------------------------------- every user error is one line


@pytest.fixture
def user_inputs(tmp_path, monkeypatch):
    """Work in ``tmp_path`` with a text file, a bad vocabulary, a bad tokenizer file and an empty folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text("a b c\nd e f\n")
    (tmp_path / "vocab.txt").write_text("x\nx\n")
    (tmp_path / "tok.json").write_text("{bad")
    (tmp_path / "empty").mkdir()
    return tmp_path


USER_ERRORS = [
    (["convert", "text", "t.txt", "o.h5", "--vocab", "vocab.txt"], "FormatError", "lists 'x' twice"),
    (["convert", "text", "t.txt", "o.h5", "--tokenizer", "tok.json"], "FormatError", "not a Hugging Face"),
    (["convert", "text", "t.txt", "o.h5", "--tokenizer", "nope"], "NotFoundError", "'nope' does not exist"),
    (["convert", "text", "t.txt", "o.h5", "--source-format", "folder"], "OptionError", "does not fit"),
    (["convert", "text", "t.txt", "o.h5", "--tokenizer", "bytes", "--min-freq", "2"], "OptionError", "'words'"),
    (["convert", "text", "t.txt", "o.h5", "--format", "arrow"], "OptionError", "disagrees with the extension"),
    (["convert", "text", "t.txt", "nowhere/o.h5"], "NotFoundError", "output folder"),
    (["convert", "text", "t.txt", "vocab.h5"], "OutputExistsError", "already exists"),  # made by the test
    (["convert", "imagefolder", "empty", "o.h5", "--size", "3x"], "OptionError", "--size"),
    (["convert", "imagefolder", "empty", "o.h5"], "SourceError", "no class folders"),
    (["info", "t.txt"], "FormatError", "unknown extension"),
    (["info", "missing.arrow"], "NotFoundError", "does not exist"),
    (["bench", "empty", "--quick"], "SourceError", "neither an image folder"),
    (["bench", "t.txt", "--workers", "0,x"], "OptionError", "--workers"),
    (["bench", "t.txt", "--json", "nowhere/x.json"], "NotFoundError", "output folder"),
    (["tune", "t.txt", "--budget", "1"], "FormatError", "unknown extension"),
    (["tune", "t.txt", "--budget", "soon"], "OptionError", "--budget"),
]


@pytest.mark.parametrize("args, error, fragment", USER_ERRORS, ids=[" ".join(args) for args, _, _ in USER_ERRORS])
def test_every_error_a_user_can_make_is_one_line_from_a_fastdata_error(user_inputs, args, error, fragment):
    (user_inputs / "vocab.h5").write_bytes(b"keep me")
    result = run(*args, "--quiet") if args[0] == "convert" else run(*args)
    assert result.exit_code == 1
    assert fragment in one_error_line(result)
    debug = run(*args, "--debug")  # the traceback's last line names the exception's class
    raised = debug.output.split("Traceback")[-1].strip().splitlines()[-2]
    assert raised.startswith(f"fastdata.errors.{error}: ")
    assert issubclass(getattr(errors, error), errors.FastdataError)
    assert (user_inputs / "vocab.h5").read_bytes() == b"keep me"


def test_an_error_that_is_not_a_fastdata_error_is_a_bug_and_shows_its_traceback(packed, monkeypatch):
    def broken(path, all_skipped=False):
        raise ValueError("a bug in describe")

    monkeypatch.setattr("fastdata.info.describe", broken)
    with pytest.raises(ValueError, match="a bug in describe"):
        run("info", packed)


def test_choices_are_the_library_constants():
    commands = {name: command for name, command in main.commands["convert"].commands.items()}
    choices = {
        ("imagefolder", "resize"): RESIZE_MODES,
        ("imagefolder", "resample"): tuple(RESAMPLE_FILTERS),
        ("imagefolder", "storage"): STORAGE_MODES,
        ("imagefolder", "on_error"): ON_ERROR,
        ("text", "source_format"): SOURCE_FORMATS,
        ("text", "on_error"): ON_ERROR,
    }
    for (command, option), constant in choices.items():
        (param,) = [p for p in commands[command].params if p.name == option]
        assert tuple(param.type.choices) == tuple(constant)


def test_convert_commands_share_their_common_options():
    def common(command):
        return {p.name: (type(p.type), p.default, p.is_flag) for p in command.params
                if p.name in ("workers", "on_error", "overwrite", "quiet", "debug")}

    images, text = (main.commands["convert"].commands[name] for name in ("imagefolder", "text"))
    assert common(images) == common(text) and len(common(images)) == 5


# ---------------------------------------------------------------- entry points


@pytest.mark.integration
def test_python_dash_m_fastdata_help():
    done = subprocess.run([sys.executable, "-m", "fastdata", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "convert" in done.stdout and "info" in done.stdout


def test_convert_help_documents_every_option():
    result = run("convert", "imagefolder", "--help")
    assert result.exit_code == 0
    for option in ("--size", "--resize", "--resample", "--storage", "--quality", "--workers", "--on-error",
                   "--overwrite", "--quiet"):
        assert option in result.output


def test_version():
    result = run("--version")
    assert result.exit_code == 0 and "0.1.0" in result.output
