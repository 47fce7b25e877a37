"""Issue 27's error-message cases through the CLI: a clear line naming the file, never a traceback or a split line."""

import os

import pytest
from support import NUM_CLASSES, PER_CLASS, folder_listing, one_error_line, run_cli

NUM_SAMPLES = NUM_CLASSES * PER_CLASS


# ---------------------------------------------------------------- a folder where one file goes


@pytest.mark.parametrize("command", ["imagefolder", "text"])
def test_overwrite_onto_a_folder_named_like_a_file_is_refused_naming_it(command, source_root, text_corpus, tmp_path):
    # Before: a raw IsADirectoryError from os.replace, after the whole conversion.
    out = tmp_path / "out.h5"
    out.mkdir()
    (out / "keep.txt").write_text("not ours")
    src = source_root if command == "imagefolder" else text_corpus / "train"
    result = run_cli("convert", command, src, out, "--overwrite", "--workers", "1", "--quiet")
    assert result.exit_code == 1
    line = one_error_line(result)
    assert repr(os.fspath(out)) in line and "is a folder" in line and "--overwrite replaces files only" in line
    assert folder_listing(tmp_path) == ["out.h5", os.path.join("out.h5", "keep.txt")]  # nothing left, nothing lost


# ---------------------------------------------------------------- one input, one line


def test_a_newline_in_an_input_name_stays_on_one_summary_line(source_copy, tmp_path):
    # Before: "  skipped class_1/bad" and "name.jpg: UnidentifiedImageError ..." on two lines.
    for index in range(7):  # more than the summary shows, so its last line names the listing command too
        (source_copy / "class_1" / f"bad{index}\nname\r.jpg").write_bytes(b"not an image")
    out = tmp_path / "odd\nout.h5"
    result = run_cli("convert", "imagefolder", source_copy, out, "--workers", "1", "--quiet")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 1 + 5 + 1, result.output  # the count, 5 skipped inputs, "... and 2 more"
    assert lines[0].startswith(f"wrote {os.fspath(out)!r}: {NUM_SAMPLES} samples") and "7 skipped" in lines[0]
    assert lines[1] == f"  skipped {os.path.join('class_1', 'bad0' + chr(10) + 'name' + chr(13) + '.jpg')!r}: " + \
        lines[1].split(": ", 1)[1]
    assert all(line.startswith("  skipped 'class_1/bad") for line in lines[1:6])
    assert lines[6].endswith(f"(all listed by: fastdata info --all {os.fspath(out)!r})")


def test_a_newline_in_a_text_input_name_stays_on_one_summary_line(tmp_path):
    src = tmp_path / "reviews"
    for label in ("neg", "pos"):
        (src / label).mkdir(parents=True)
        (src / label / "ok.txt").write_text(f"a fine {label} review")
    (src / "pos" / "empty\nreview.txt").write_text("")
    result = run_cli("convert", "text", src, tmp_path / "out.h5", "--workers", "1", "--quiet")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 2 and "1 skipped" in lines[0], result.output
    assert lines[1].startswith(f"  skipped {os.path.join('pos', 'empty' + chr(10) + 'review.txt')!r}: "), lines[1]
