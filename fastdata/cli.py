"""Command line: `fastdata convert | info | bench | tune` (thin wrappers over the library)."""

import functools
import os
import signal
import sys
import traceback

import click

# The choices of the options are the library's own constants. Importing
# them loads the converters (h5py, pyarrow, Pillow): `fastdata --help` starts
# in ~0.7 s instead of ~0.1 s (python -X importtime, 2 cores); every other
# command loads most of them anyway.
from fastdata.cliparse import ByteSize, parse_counts, parse_duration, parse_part, parse_size, parse_storage_options
from fastdata.codecs.images import RESAMPLE_FILTERS, RESIZE_MODES
from fastdata.converters.imagefolder import STORAGE_MODES
from fastdata.converters.report import ON_ERROR
from fastdata.converters.staging import check_output
from fastdata.converters.textsources import SOURCE_FORMATS
from fastdata.errors import FastdataError, NotFoundError
from fastdata.formats.records import IMAGE_MODES, IMAGE_STORAGES
from fastdata.formats.shards import CONTAINER_EXTENSIONS

CONTAINERS = tuple(CONTAINER_EXTENSIONS)


def _reports_errors(command):
    """Print a FastdataError as one line and exit 1 (anything else is a bug: its traceback shows)."""

    @functools.wraps(command)
    def wrapper(*args, debug=False, **kwargs):
        try:
            return command(*args, **kwargs)
        except FastdataError as exc:
            if debug:
                traceback.print_exc()
            raise click.ClickException(str(exc)) from exc

    return click.option("--debug", is_flag=True, help="Show the full traceback on errors.")(wrapper)


def _conversion_options(work, bad_input):
    """Add the options every ``convert`` command takes: --workers, --on-error, --overwrite, --quiet."""
    options = [
        click.option("--workers", type=click.IntRange(min=1), default=None,
                     help=f"{work} processes [default: all cores]."),
        click.option("--on-error", type=click.Choice(ON_ERROR), default="skip", show_default=True,
                     help=f"What to do with {bad_input}."),
        click.option("--overwrite", is_flag=True, help="Replace OUT if it exists."),
        click.option("--quiet", is_flag=True, help="No progress bar."),
    ]
    return lambda command: functools.reduce(lambda command, option: option(command), reversed(options), command)


_storage_option = click.option(
    "--storage-option", "storage_options", multiple=True, metavar="KEY=VALUE",
    help="URL OUT: an fsspec storage option (endpoint_url=..., anon=true, profile=...); repeatable. "
         "Credentials default to fsspec's own (environment variables, config files).")


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
@click.argument("out", type=click.Path())
@click.option("--size", default="64", show_default=True, help="Stored size: N (square) or HxW.")
@click.option("--resize", type=click.Choice(RESIZE_MODES), default="crop", show_default=True,
              help="crop: cover then center-crop; pad: fit then pad; stretch: ignore aspect ratio.")
@click.option("--resample", type=click.Choice(list(RESAMPLE_FILTERS)), default="bilinear",
              show_default=True, help="Resampling filter.")
@click.option("--storage", type=click.Choice(STORAGE_MODES), default="raw", show_default=True,
              help="raw: uint8 pixels (fastest to load); jpeg: re-encoded, 5-10x smaller.")
@click.option("--quality", type=click.IntRange(1, 100), default=90, show_default=True,
              help="JPEG quality with --storage jpeg.")
@_conversion_options("Decoding", "an image that cannot be decoded")
@click.option("--format", "container", type=click.Choice(CONTAINERS), default=None,
              help="Shard folder OUT: container of the shard files [default: hdf5].")
@click.option("--shard-size", type=ByteSize(), default=None,
              help="Shard folder OUT: bytes per shard file: 64MB, 256MiB, 1GB or plain bytes [default: 64MiB].")
@click.option("--resume", is_flag=True,
              help="Shard folder OUT: finish an interrupted conversion, keeping its intact shards; on a finished OUT, "
                   "check every file and redo those missing or damaged.")
@click.option("--dask", "dask_address", default=None, metavar="ADDRESS",
              help="Shard folder OUT: convert on the Dask cluster of this scheduler (tcp://HOST:8786); "
                   "OUT must be a folder its workers see, or a URL they reach.")
@click.option("--part", default=None, metavar="I/N",
              help="Shard folder OUT: write only part I of N (shards k with k % N == I); the last part to "
                   "finish writes the index.")
@_storage_option
@_reports_errors
def convert_imagefolder_command(src, out, size, resize, resample, storage, quality, workers, on_error, overwrite,
                                quiet, container, shard_size, resume, dask_address, part, storage_options):
    """Pack the ImageFolder tree SRC (SRC/<class>/<image>) into OUT: a .h5/.hdf5/.arrow file, or a shard folder.

    Any OUT without one of those extensions is a shard folder: shard files of
    about --shard-size bytes and index.json. A URL OUT (s3://bucket/train/, any
    fsspec URL) is a shard folder there: each shard is uploaded as it is
    finished, index.json last.
    """
    from fastdata.converters import convert_imagefolder
    from fastdata.converters.parallel import dask_client

    client = dask_client(dask_address) if dask_address else None
    try:
        report = convert_imagefolder(
            src, out, size=parse_size(size), resize=resize, resample=resample, storage=storage, quality=quality,
            workers=workers, on_error=on_error, overwrite=overwrite, progress=not quiet, format=container,
            shard_size=shard_size, resume=resume, executor=client,
            part=parse_part(part), storage_options=parse_storage_options(storage_options),
        )
    finally:
        if client is not None:
            client.close()
    click.echo(str(report))


@convert.command("text")
@click.argument("src", type=click.Path(exists=True))
@click.argument("out", type=click.Path())
@click.option("--tokenizer", default="words", show_default=True,
              help="words (built in), bytes (UTF-8 bytes as ids), a Hugging Face tokenizers .json file, "
                   "or a packed .h5/.arrow file or shard folder whose tokenizer to reuse (e.g. train.h5 for the "
                   "test split).")
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
@click.option("--source-format", type=click.Choice(SOURCE_FORMATS), default=None,
              help="How to read SRC [default: folder, or by file extension; other files: one text per line].")
@click.option("--text-field", default="text", show_default=True,
              help="CSV or Parquet column / JSON field with the text.")
@click.option("--label-field", default="label", show_default=True,
              help="CSV or Parquet column / JSON field with the label.")
@click.option("--no-labels", is_flag=True, help="CSV/JSONL/Parquet: store no labels (all -1).")
@click.option("--eod", default=None, metavar="TOKEN",
              help="Record the end-of-document token (or id) of the tokenizer for language-model sequences "
                   "(make_loader(seq_len=...)); nothing is inserted.")
@click.option("--unsup/--no-unsup", default=False, show_default=True,
              help="Folder SRC: also store the unsup folder, unlabeled (label -1).")
@click.option("--format", "container", type=click.Choice(CONTAINERS), default=None,
              help="Shard folder OUT: container of the shard files [default: hdf5].")
@click.option("--shard-size", type=ByteSize(), default=None,
              help="Shard folder OUT: bytes per shard file: 64MB, 256MiB, 1GB or plain bytes [default: 64MiB].")
@click.option("--resume", is_flag=True,
              help="Shard folder OUT: keep a finished OUT of these settings if intact, convert it again if a file "
                   "is missing or damaged; an interrupted text conversion left nothing behind and starts again "
                   "(its vocabulary needs every text).")
@_conversion_options("Tokenizing", "an unusable input (not UTF-8, empty, missing field, bad label)")
@_storage_option
@_reports_errors
def convert_text_command(src, out, tokenizer, vocab, min_freq, max_vocab, max_length, lowercase, strip_html,
                         source_format, text_field, label_field, no_labels, eod, unsup, container, shard_size,
                         resume, workers, on_error, overwrite, quiet, storage_options):
    """Tokenize the text corpus SRC once into OUT: a .h5, .hdf5 or .arrow file, or else a shard folder.

    SRC is a folder SRC/<label>/<sample>.txt (e.g. aclImdb/train), a .csv/.tsv
    file with a header, a .jsonl file, or a text file with one sample per line.
    A shard folder OUT holds shard files and index.json, and appears whole
    when the conversion ends.
    """
    from fastdata.converters import convert_text

    report = convert_text(
        src, out, tokenizer=tokenizer, vocab=vocab, min_freq=min_freq, max_vocab=max_vocab, max_length=max_length,
        lowercase=lowercase, strip_html=strip_html, source_format=source_format, text_field=text_field,
        label_field=None if no_labels else label_field, include_unsup=unsup, workers=workers, on_error=on_error,
        overwrite=overwrite, progress=not quiet, format=container, shard_size=shard_size, resume=resume,
        storage_options=parse_storage_options(storage_options), eod=int(eod) if eod and eod.isdigit() else eod,
    )
    if resume and not report.finished and not report.redone:
        click.echo("note: --resume: a text conversion starts again from the first text (its vocabulary needs "
                   "every text); an interrupted one left nothing behind", err=True)
    click.echo(str(report))


def _image_field_options(command):
    """Add the options of a record source's image fields (--size, --storage, --quality, --resize) and its output's
    (--format, --shard-size, --resume, --part, --storage-option)."""
    options = [
        click.option("--size", default="64", show_default=True, help="Stored image size: N (square) or HxW."),
        click.option("--storage", type=click.Choice(IMAGE_STORAGES), default="raw", show_default=True,
                     help="Images stored decoded (raw, the fastest to load), or as JPEG or PNG."),
        click.option("--quality", type=click.IntRange(1, 100), default=None, help="JPEG quality [default: 90]."),
        click.option("--resize", type=click.Choice(RESIZE_MODES), default=None,
                     help="How images reach --size [default: crop; pad for coco]."),
        click.option("--mode", type=click.Choice(IMAGE_MODES), default=None,
                     help="Images stored in colour (RGB, the default) or grey (L: one channel)."),
        click.option("--format", "container", type=click.Choice(CONTAINERS), default=None,
                     help="A shard folder OUT's container [default: hdf5]; a file's is its extension's."),
        click.option("--shard-size", type=ByteSize(), default=None,
                     help="A shard folder OUT's bytes per shard (64MB, 256MiB...) [default: 64 MiB]."),
        click.option("--resume", is_flag=True,
                     help="A shard folder OUT: finish an interrupted conversion, keeping its intact shards; on a "
                          "finished OUT, check every file and redo those missing or damaged."),
        click.option("--part", default=None, metavar="I/N",
                     help="A shard folder OUT: write only part I of N (shards k with k % N == I), reading every "
                          "row; the last part to finish writes the index."),
        _storage_option,
    ]
    return functools.reduce(lambda command, option: option(command), reversed(options), command)


def _write_records(convert, *args, size, workers, quiet, container, part, storage_options, **options):
    """Run a record source's ``convert`` with the CLI's options and print its report."""
    report = convert(*args, size=parse_size(size), workers=workers or 1, progress=not quiet, format=container,
                     part=parse_part(part), storage_options=parse_storage_options(storage_options), **options)
    click.echo(str(report))


@convert.command("table")
@click.argument("src", type=click.Path(exists=True, dir_okay=False))
@click.argument("out", type=click.Path())
@click.option("--image", "images", multiple=True, metavar="COLUMN",
              help="A column of image paths (relative to SRC's folder) or bytes; repeatable.")
@_image_field_options
@_conversion_options("Encoding", "rows that do not fit their column's type")
@_reports_errors
def convert_table_command(src, out, images, **options):
    """Pack the CSV/TSV/JSONL/Parquet manifest SRC into the record file OUT (.h5, .hdf5 or .arrow), or the shard
    folder OUT (any other name).

    Every column becomes a field of its type (Parquet's own; CSV text as int or
    float where every value reads back as written); --image columns are images.
    """
    from fastdata.converters.recordsources import convert_table

    _write_records(convert_table, src, out, image=images, **options)


@convert.command("hf")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path())
@click.option("--image", "images", multiple=True, metavar="COLUMN",
              help="A column of image paths or bytes besides the Image features; repeatable.")
@_image_field_options
@_conversion_options("Encoding", "rows that do not fit their feature's type")
@_reports_errors
def convert_hf_command(src, out, images, **options):
    """Pack the Hugging Face dataset folder SRC (written by save_to_disk) into the record file OUT."""
    from fastdata.converters.recordsources import convert_hf

    _write_records(convert_hf, src, out, image=images, **options)


@convert.command("webdataset")
@click.argument("srcs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.argument("out", type=click.Path())
@_image_field_options
@_conversion_options("Encoding", "samples that do not fit the first sample's fields")
@_reports_errors
def convert_webdataset_command(srcs, out, **options):
    """Pack the WebDataset .tar shards SRCS into the record file OUT: a field per member extension."""
    from fastdata.converters.recordsources import convert_webdataset

    _write_records(convert_webdataset, list(srcs), out, **options)


@convert.command("coco")
@click.argument("annotations", type=click.Path(exists=True, dir_okay=False))
@click.argument("out", type=click.Path())
@click.option("--images", "images_root", type=click.Path(exists=True, file_okay=False), default=None,
              help="The folder of the images [default: the annotations' folder].")
@_image_field_options
@_conversion_options("Encoding", "images that cannot be used")
@_reports_errors
def convert_coco_command(annotations, out, images_root, resize, **options):
    """Pack a COCO-style detection set (ANNOTATIONS json + images) into the record file OUT, boxes moved with
    their images."""
    from fastdata.converters.coco import convert_coco

    _write_records(convert_coco, annotations, out, images=images_root, resize=resize or "pad", **options)


@main.command()
@click.argument("path", type=click.Path())
@click.option("--all", "all_skipped", is_flag=True, help="List every skipped input, not only the first 10.")
@_reports_errors
def info(path, all_skipped):
    """Describe the packed file or shard folder PATH: samples, classes, shape, statistics, shards, skipped inputs."""
    from fastdata.info import describe

    click.echo(describe(path, all_skipped=all_skipped))


@main.command("bench")
@click.argument("target", type=click.Path(exists=True))
@click.option("--batch-size", type=click.IntRange(min=1), default=256, show_default=True, help="Samples per batch.")
@click.option("--workers", default="0,2", show_default=True,
              help="Worker processes to measure, comma-separated; 0 is make_loader's in-process default.")
@click.option("--repeats", type=click.IntRange(min=1), default=None,
              help="Timed passes per row, after one warm-up epoch [default: 3; --quick: 1].")
@click.option("--seconds", type=click.FloatRange(min=0), default=None,
              help="Shortest timed pass in seconds; shorter epochs are repeated [default: 0.25; --quick: 0.05].")
@click.option("--size", type=click.IntRange(min=1), default=64, show_default=True,
              help="Image folder: side in pixels of the packed images (the raw rows resize to it too).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None,
              help="Also write every number and the machine description to this JSON file.")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), default=None,
              help="Also draw the rates into this PNG file (needs fastdata[plot]).")
@click.option("--quick", is_flag=True, help="One short timed pass per row: a rough look.")
@click.option("--overwrite", is_flag=True, help="Replace the --json and --plot files if they exist.")
@click.option("--quiet", is_flag=True, help="No progress lines.")
@_reports_errors
def bench_command(target, batch_size, workers, repeats, seconds, size, json_out, plot_out, quick, overwrite, quiet):
    """Measure loading TARGET: a packed .h5/.arrow file, or an image or text folder.

    A folder is converted to temporary .h5 and .arrow files, and reading its
    raw files is compared with reading those.
    """
    from fastdata._optional import require
    from fastdata.measure.bench import benchmark, format_results, plot_results
    from fastdata.measure.tables import write_json

    for out in (json_out, plot_out):
        if out is not None:
            check_output(out, overwrite)
    if plot_out:
        require("matplotlib", "plot", "fastdata bench --plot")
    results = benchmark(
        target, batch_size=batch_size, workers=parse_counts("--workers", workers), size=size, progress=not quiet,
        repeats=repeats or (1 if quick else 3), min_seconds=(0.05 if quick else 0.25) if seconds is None else seconds,
    )
    click.echo(format_results(results))
    if json_out:
        click.echo(f"wrote {write_json(results, json_out)}")
    if plot_out:
        click.echo(f"wrote {plot_results(results, plot_out)}")


@main.command("tune")
@click.argument("path", type=click.Path(exists=True))
@click.option("--budget", default="60s", show_default=True,
              help="Time to spend measuring: seconds (60, 60s) or minutes (2m).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None,
              help="Where to save the result [default: PATH.tune.json beside PATH, where "
                   "make_loader(num_workers='auto') finds it].")
@click.option("--max-workers", type=click.IntRange(min=0), default=None,
              help="Most worker processes to try [default: 2 x usable CPUs].")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Keep this batch size and tune the other settings [default: search 64 to 1024].")
@click.option("--overwrite", is_flag=True, help="Replace the JSON file if it exists.")
@_reports_errors
def tune_command(path, budget, json_out, max_workers, batch_size, overwrite):
    """Search make_loader settings for the packed file or shard folder PATH on this machine, within a time budget.

    Prints each measured setting and the recommended make_loader call, and
    saves them as JSON; make_loader(dataset, num_workers="auto") then uses the
    tuned num_workers and prefetch_factor.
    """
    from fastdata.loading.recommendation import tune_json_path
    from fastdata.measure.tune import format_trial, tune_loader, write_tune_json

    out = json_out or tune_json_path(path)
    check_output(out, overwrite)
    result = tune_loader(path, budget=parse_duration("--budget", budget), max_workers=max_workers,
                         batch_size=batch_size, on_trial=lambda trial: click.echo(format_trial(trial)))
    click.echo(str(result))
    click.echo(f"wrote {write_tune_json(result, out)}")


@main.command("index")
@click.argument("root", type=click.Path(file_okay=False))
@_storage_option
@_reports_errors
def index_command(root, storage_options):
    """Write ROOT/index.json of a shard folder (or URL) whose parts (--part i/n) have all finished.

    Names the shards that are not finished yet, if any.
    """
    from fastdata.converters.imageshards import shard_folder_metadata
    from fastdata.converters.recordshards import record_folder_metadata
    from fastdata.converters.shards import index_shards
    from fastdata.converters.upload import remote_output
    from fastdata.formats.records import RECORDS_KIND

    def folder_metadata(plan, records):
        return (record_folder_metadata if plan.get("kind") == RECORDS_KIND else shard_folder_metadata)(plan, records)

    remote = remote_output(root, parse_storage_options(storage_options), folder=True)
    if remote is None and not os.path.isdir(root):
        raise NotFoundError(f"{root!r} is not a folder; give the shard folder the parts wrote")
    metadata = index_shards(root if remote is None else remote.worker_root(), folder_metadata, remote=remote)
    click.echo(f"wrote {root.rstrip('/') or '/'}/index.json: {metadata['num_samples']} samples")


@main.command("verify")
@click.argument("path", type=click.Path())
@click.option("--quick", is_flag=True,
              help="Check the stored chunk checksums only: no whole-shard crc32, no value checks, no decoding.")
@_reports_errors
def verify_command(path, quick):
    """Check the packed file or shard folder PATH for damage: checksums, structure, offsets, labels, JPEGs, token ids.

    A shard folder is checked shard by shard (size and crc32 against its index, then as one file); problems name
    the shard file. Exits 0 when intact and 1 when damaged, naming the damaged samples.
    """
    from fastdata.verify import verify

    report = verify(path, quick=quick)
    click.echo(str(report))
    if not report.ok:
        raise SystemExit(1)
