"""Command line: `fastdata convert | info` (thin wrappers over the library)."""

import functools
import signal
import sys
import traceback

import click

from fastdata.errors import FastdataError


def _reports_errors(command):
    """Print a FastdataError (or bad file/argument) as one line and exit 1."""

    @functools.wraps(command)
    def wrapper(*args, debug=False, **kwargs):
        try:
            return command(*args, **kwargs)
        except (FastdataError, FileNotFoundError, FileExistsError, ValueError) as exc:
            if debug:
                traceback.print_exc()
            raise click.ClickException(str(exc)) from exc

    return click.option("--debug", is_flag=True, help="Show the full traceback on errors.")(wrapper)


@click.group()
@click.version_option(package_name="fastdata")
def main():
    """Pack datasets once, then train from the packed file at memory speed."""
    # A terminated conversion unwinds like Ctrl-C, so its staging files go.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


@main.group()
def convert():
    """Convert a raw dataset into a packed .h5 or .arrow file."""


@convert.command("imagefolder")
@click.argument("src", type=click.Path(file_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--size", default="64", show_default=True, help="Stored size: N (square) or HxW.")
@click.option("--resize", type=click.Choice(["crop", "pad", "stretch"]), default="crop", show_default=True,
              help="crop: cover then center-crop; pad: fit then pad; stretch: ignore aspect ratio.")
@click.option("--resample", type=click.Choice(["bilinear", "bicubic", "lanczos", "nearest"]), default="bilinear",
              show_default=True, help="Resampling filter.")
@click.option("--storage", type=click.Choice(["raw", "jpeg"]), default="raw", show_default=True,
              help="raw: uint8 pixels (fastest to load); jpeg: re-encoded, 5-10x smaller.")
@click.option("--quality", type=click.IntRange(1, 100), default=90, show_default=True,
              help="JPEG quality with --storage jpeg.")
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Decoding processes [default: all cores].")
@click.option("--on-error", type=click.Choice(["skip", "warn", "raise"]), default="skip", show_default=True,
              help="What to do with an image that cannot be decoded.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@_reports_errors
def convert_imagefolder_command(src, out, size, resize, resample, storage, quality, workers, on_error, overwrite,
                                quiet):
    """Pack the ImageFolder tree SRC (SRC/<class>/<image>) into OUT (.h5, .hdf5 or .arrow)."""
    from fastdata.converters import convert_imagefolder

    report = convert_imagefolder(
        src, out, size=_parse_size(size), resize=resize, resample=resample, storage=storage, quality=quality,
        workers=workers, on_error=on_error, overwrite=overwrite, progress=not quiet,
    )
    click.echo(str(report))


@convert.command("text")
@click.argument("src", type=click.Path(exists=True))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--tokenizer", default="words", show_default=True,
              help="words (built in), bytes (UTF-8 bytes as ids), a Hugging Face tokenizers .json file, "
                   "or a packed .h5/.arrow file whose tokenizer to reuse (e.g. train.h5 for the test split).")
@click.option("--vocab", type=click.Path(exists=True, dir_okay=False), default=None,
              help="words: vocabulary file, one token per line, instead of building one from SRC.")
@click.option("--min-freq", type=click.IntRange(min=1), default=1, show_default=True,
              help="words: leave out tokens seen fewer times (they become <unk>).")
@click.option("--max-vocab", type=click.IntRange(min=3), default=None,
              help="words: largest vocabulary size, <pad> and <unk> included.")
@click.option("--max-length", type=click.IntRange(min=1), default=None, help="Keep at most this many ids per sample.")
@click.option("--lowercase/--no-lowercase", default=None,
              help="Lower-case the text [default: on for words, off otherwise].")
@click.option("--strip-html/--keep-html", default=None,
              help="Replace HTML line breaks (<br />) by spaces [default: on, off for tokenizer files].")
@click.option("--source-format", type=click.Choice(["folder", "csv", "tsv", "jsonl", "lines"]), default=None,
              help="How to read SRC [default: folder, or by file extension; other files: one text per line].")
@click.option("--text-field", default="text", show_default=True, help="CSV column / JSON field with the text.")
@click.option("--label-field", default="label", show_default=True, help="CSV column / JSON field with the label.")
@click.option("--no-labels", is_flag=True, help="CSV/JSONL: store no labels (all -1).")
@click.option("--unsup/--no-unsup", default=False, show_default=True,
              help="Folder SRC: also store the unsup folder, unlabeled (label -1).")
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Tokenizing processes [default: all cores].")
@click.option("--on-error", type=click.Choice(["skip", "warn", "raise"]), default="skip", show_default=True,
              help="What to do with an unusable input (not UTF-8, empty, missing field, bad label).")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@_reports_errors
def convert_text_command(src, out, tokenizer, vocab, min_freq, max_vocab, max_length, lowercase, strip_html,
                         source_format, text_field, label_field, no_labels, unsup, workers, on_error, overwrite,
                         quiet):
    """Tokenize the text corpus SRC once into OUT (.h5, .hdf5 or .arrow).

    SRC is a folder SRC/<label>/<sample>.txt (e.g. aclImdb/train), a .csv/.tsv
    file with a header, a .jsonl file, or a text file with one sample per line.
    """
    from fastdata.converters import convert_text

    report = convert_text(
        src, out, tokenizer=tokenizer, vocab=vocab, min_freq=min_freq, max_vocab=max_vocab, max_length=max_length,
        lowercase=lowercase, strip_html=strip_html, source_format=source_format, text_field=text_field,
        label_field=None if no_labels else label_field, include_unsup=unsup, workers=workers, on_error=on_error,
        overwrite=overwrite, progress=not quiet,
    )
    click.echo(str(report))


@main.command()
@click.argument("path", type=click.Path(dir_okay=False))
@_reports_errors
def info(path):
    """Describe the packed file PATH: samples, classes, shape, statistics, skipped inputs."""
    from fastdata.info import describe

    click.echo(describe(path))


def _parse_size(text):
    parts = text.lower().split("x")
    try:
        sizes = [int(part) for part in parts]
    except ValueError:
        sizes = []
    if len(sizes) not in (1, 2) or min(sizes) < 1:
        raise ValueError(f"--size should be N or HxW with positive integers, got {text!r}")
    return sizes[0] if len(sizes) == 1 else tuple(sizes)
