"""`fastdata info`: every skipped input can be listed, names stay on one line, damaged files are named."""

import os

import numpy as np
import pytest
from support import column_regions, overwrite, private_copy, run_cli

from fastdata import convert_imagefolder
from fastdata.info import describe


@pytest.fixture
def many_skipped(source_copy, tmp_path):
    """A file converted from a folder with 12 unreadable images; returns ``(path, report)``."""
    for index in range(12):
        (source_copy / "class_0" / f"bad_{index:02d}.png").write_text("junk")
    out = tmp_path / "out.h5"
    return out, convert_imagefolder(source_copy, out, workers=1, progress=False)


def test_info_all_lists_every_skipped_input(many_skipped):
    out, _ = many_skipped
    brief, full = run_cli("info", out), run_cli("info", out, "--all")
    assert brief.exit_code == full.exit_code == 0, full.output
    assert "bad_09.png" in brief.output and "bad_10.png" not in brief.output
    assert "... and 2 more (fastdata info --all lists them all)" in brief.output
    assert all(f"bad_{index:02d}.png" in full.output for index in range(12))
    assert "more" not in full.output


def test_the_conversion_report_names_a_command_that_lists_them_all(many_skipped):
    out, report = many_skipped
    command = str(report).splitlines()[-1].split("(all listed by: ")[1].rstrip(")")
    assert command == f"fastdata info --all {out}"
    result = run_cli(*command.split()[1:])
    assert sum(line.startswith("  'class_0/bad_") for line in result.output.splitlines()) == 12


def test_a_newline_in_a_path_cannot_split_a_line(source_copy, tmp_path):
    (source_copy / "class_1" / "two\nlines.png").write_text("junk")
    out = tmp_path / "odd\nname.h5"
    convert_imagefolder(source_copy, out, workers=1, progress=False)
    text = describe(out)
    lines = text.splitlines()
    assert f"file:        {os.fspath(out)!r}" in text
    assert f"  {os.path.join('class_1', 'two' + chr(10) + 'lines.png')!r}: " in text
    assert not any(line.startswith(("lines.png", "name.h5")) for line in lines), text
    assert len(lines) == len(describe(private_copy(out, tmp_path, "plain")).splitlines())


@pytest.mark.parametrize("fmt", ["hdf5", "arrow"])
@pytest.mark.parametrize("kind", ["jpeg", "text"])
def test_info_on_a_damaged_file_names_it(packed_files, packed_text, fmt, kind, tmp_path):
    # Before, for Arrow JPEG files: "Error: buffer is smaller than requested size", no file named.
    path = private_copy(packed_text(fmt) if kind == "text" else packed_files(fmt, kind), tmp_path, "damaged")
    offsets_at, nbytes = column_regions(path)["offsets"]
    overwrite(path, offsets_at + nbytes - 8, np.int64(2**40).tobytes())  # the last offset
    result = run_cli("info", path)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and os.fspath(path) in lines[0], result.output
    assert "damaged" in lines[0] and "fastdata verify" in lines[0]


def test_info_shows_the_source_and_the_files_left_out(source_copy, tmp_path):
    (source_copy / "class_0" / "notes.txt").write_text("not an image")
    (source_copy / "class_1" / ".hidden.jpg").write_bytes(b"")
    out = tmp_path / "out.h5"
    convert_imagefolder(source_copy, out, size=16, workers=1, progress=False)
    lines = describe(out).splitlines()
    assert f"source:      num_inputs=24, root={os.fspath(source_copy)!r}" in lines
    assert "ignored:     2 files that are not inputs (.txt: 1, hidden: 1)" in lines

