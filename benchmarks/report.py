"""Results of run.py: the targets as measured ratios, the Markdown report, the files written.

Every target compares two figures measured in the same run; nothing here
is typed in by hand except the thresholds of the issue's bars.
"""

import hashlib
import json
import os
import subprocess
import sys

from benchmarks.machine import cuda_device
from fastdata.measure.machine import describe_machine as machine_info
from fastdata.measure.machine import installed_version
from fastdata.measure.tables import markdown_table

PEER_VS_DEFAULTS = 10.0  # packed raw, defaults: about 10x the best other tool (0 workers)
PEER_VS_WORKERS = 3.0  # packed raw, num_workers=2 forced: at least 3x the best other tool's 2-worker row
EXTRA_VERSIONS = ("simplejpeg", "datasets", "webdataset", "psutil", "matplotlib")


def assemble(config, machine, sections, seconds, busy_after):
    """Return the results dict: config, machine, sections, targets and the Markdown report.

    ``machine`` is describe_machine()'s at the start; the end of the run adds
    the CPU use after it, the page-cache facts and whether fastdata's code
    changed on disk meanwhile.
    """
    machine = {**machine, "busy_percent_after": busy_after}
    machine["fastdata_changed_during_run"] = _code_state(machine.get("fastdata_file")) != machine.pop("_code_state")
    cold = sections.get("coldcache", {})
    machine["page_cache_drop"] = {"methods": cold.get("drop_methods"), "notes": cold.get("notes")} if cold else None
    results = {
        "benchmark": "fastdata suite (benchmarks/run.py)",
        "config": config,
        "machine": machine,
        "run_seconds": seconds,
        "sections": sections,
    }
    results["targets"] = collect_targets(sections)
    results["markdown"] = markdown(results)
    return results


def describe_machine(fresh, busy_before):
    """Return machine_info() at the start of the run, plus the extras' versions and CUDA (asked in a fresh process)."""
    info = machine_info()
    info["versions"].update({name: installed_version(name) for name in EXTRA_VERSIONS})
    info["cuda"] = fresh.run(cuda_device)
    info["busy_percent_before"] = busy_before
    info["_code_state"] = _code_state(info.get("fastdata_file"))
    return info


def _code_state(fastdata_file):
    """Return a fingerprint of fastdata's checkout (HEAD and uncommitted changes), or None."""
    if not fastdata_file:
        return None
    folder = os.path.dirname(fastdata_file)
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, timeout=10)
        diff = subprocess.run(["git", "diff", "HEAD", "--", "."], cwd=folder, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return hashlib.sha1(done.stdout + diff.stdout).hexdigest()


# ---------------------------------------------------------------- targets


def finish(target, section):
    """Return ``target`` with its verdict: pass, and margin (>= 1 when it passes; None for an "at most" of 0)."""
    at_least = target.get("at_least", True)
    value, threshold = target["value"], target["threshold"]
    passed = value >= threshold if at_least else value <= threshold
    if at_least:
        margin = value / threshold
    else:
        margin = threshold / value if value > 0 else None  # JSON has no infinity
    return {"section": section, **target, "at_least": at_least, "pass": bool(passed), "margin": margin}


def collect_targets(sections):
    """Return every target of every section that ran, with its verdict."""
    targets = []
    for size, result in (sections.get("images", {}).get("sizes") or {}).items():
        for target in result["targets"]:
            own = "raw folder" in target["name"]  # the images section's 300x target, not in the issue
            info = "images.py's own target (set at 64x64), not one of the issue's bars" if own else ""
            targets.append(finish({**target, "name": f"images {size}px: {target['name']}", "info": info}, "images"))
    targets += [finish(t, "images+peers") for t in peer_targets(sections)]
    for name in ("gpustep", "text", "memory", "shards", "scale", "augment", "fusedcrop", "training", "streaming",
                 "busystep", "gpu", "records", "lm", "lmscale"):
        targets += [finish(t, name) for t in sections.get(name, {}).get("targets", [])]
    return targets


def peer_targets(sections):
    """Compare packed raw rows (images section) with the best other tool (peers section) at the same size."""
    peers = sections.get("peers") or {}
    images = ((sections.get("images") or {}).get("sizes") or {}).get(str(peers.get("size")))
    measured = [row for row in peers.get("rows", []) if "samples_per_s" in row]
    if not images or not measured:
        return []
    rates = {row["key"]: row["samples_per_s"] for row in images["loading"]}
    targets = []
    for workers, suffix, threshold in ((False, "", PEER_VS_DEFAULTS), (True, "_workers", PEER_VS_WORKERS)):
        candidates = [row for row in measured if (row["num_workers"] > 0) == workers]
        if not candidates:
            continue
        best = max(candidates, key=lambda row: row["samples_per_s"])
        for fmt in ("hdf5", "arrow"):
            rate = rates[f"{fmt}-raw{suffix}"]
            what = "num_workers=2 forced" if workers else "make_loader defaults"
            targets.append({"name": f"{fmt} raw {peers['size']}px, {what} vs best other tool at "
                                    f"{best['num_workers']} workers ({best['tool_name']})",
                            "value": rate / best["samples_per_s"], "threshold": threshold,
                            "info": f"{rate:,.0f} vs {best['samples_per_s']:,.0f} samples/s"})
    return targets


def targets_table(targets):
    body = []
    for t in targets:
        unit = t.get("unit", "")
        if unit:  # "MB", "s", "img/s", ...
            value = f"{t['value']:,.2f} {unit}"
            threshold = f"{'>=' if t['at_least'] else '<='} {t['threshold']:,g} {unit}"
        elif t["at_least"]:
            value = f"{t['value']:,.3f}x" if t["value"] < 10 else f"{t['value']:,.1f}x"
            threshold = f">= {t['threshold']:g}x"
        else:
            value, threshold = f"{t['value']:.2%}", f"<= {t['threshold']:.0%}"
        margin = "-" if t["margin"] is None else f"{t['margin']:.2f}"
        body.append(("PASS" if t["pass"] else "FAIL", t["name"], value, threshold, margin, t.get("info", "")))
    return markdown_table(["result", "target", "measured", "bar", "margin (>= 1 passes)", "note"], body, "llrrrl")


# ---------------------------------------------------------------- Markdown


def markdown(results):
    """Return the whole report as Markdown."""
    sections = results["sections"]
    parts = ["# fastdata benchmark results", "", machine_text(results), ""]
    if results["targets"]:
        passed = sum(t["pass"] for t in results["targets"])
        parts += [f"## Targets ({passed} of {len(results['targets'])} pass)", "", targets_table(results["targets"]), ""]
    for name, render in _RENDERERS:
        section = sections.get(name)
        if section is None:
            continue
        if "error" in section:
            parts += [f"## {name}: FAILED", "", "```", section["error"].strip(), "```", ""]
            continue
        parts += [render(section, results["config"]), ""]
    return "\n".join(parts).rstrip() + "\n"


def machine_text(results):
    m, config = results["machine"], results["config"]
    versions = ", ".join(f"{name} {version}" for name, version in m["versions"].items() if version)
    ram = f"{m['ram_bytes'] / 2**30:.0f} GiB RAM" if m.get("ram_bytes") else "RAM unknown"
    commit = (m.get("fastdata_git_commit") or "unknown")[:12]
    commit += " (with uncommitted changes)" if m.get("fastdata_git_dirty") else ""
    if m.get("fastdata_changed_during_run"):
        commit += (" at the start; fastdata's files CHANGED on disk during the run (measuring processes had "
                   "imported it at the start; processes started later read the new files)")
    busy = f"{m.get('busy_percent_before')}% / {m.get('busy_percent_after')}%"
    flags = "--quick" if config["quick"] else "(full)"
    return "\n".join([
        f"Measured {m['date']} on {m.get('cpu_model')}: {m['usable_cpus']} usable of {m['cpu_count']} cores, {ram}, "
        f"{m['platform']}, Python {m['python']}, {'CUDA ' + m['cuda'] if m.get('cuda') else 'no GPU'}.",
        f"Versions: {versions}. fastdata commit {commit}.",
        f"CPU use by other processes before / after the run: {busy}. Run {flags} took {results['run_seconds']:.0f} s; "
        f"{config['repeats']} timed passes per figure after a warm-up pass, batch {config['batch_size']}, "
        f"{config['workers']} workers where forced.",
    ])


def images_text(section, config):
    from benchmarks.inputs import PHOTO_SIZE

    parts = []
    for size, result in section["sizes"].items():
        count = result["source"]["num_images"]
        w, h = PHOTO_SIZE
        parts += [f"## Images: {count} photo-like JPEGs (varied sizes around {w}x{h}) -> {size}x{size}, "
                  f"batch {config['batch_size']}, shuffled", "", result["tables"]["loading"], "",
                  "samples/s: median of timed passes of whole epochs after a warm-up epoch, each row in a fresh "
                  f"process; rows other than the raw folder: the median of {section['process_repeats']} fresh "
                  "processes (see NOTE [process to process] in fresh.py). LIMIT: the faster direct copy from the "
                  "memory map. Worker memory: mean over worker processes at the end, USS (private dirty).", "",
                  result["tables"]["jpeg_pairs"], "", result["tables"].get("abandoned", ""), "",
                  f"### Conversion of the {count} JPEGs to {size}x{size}", "", result["tables"]["conversion"], ""]
    return "\n".join(parts).rstrip()


def gpustep_text(section, config):
    return "\n".join([f"## Simulated GPU step ({section['step_ms']:g} ms sleep per batch of {config['batch_size']}, "
                      f"epochs of {section['batches_per_epoch']} batches)", "", section["table"]])


def text_text(section, config):
    padding = section["padding"]
    return "\n".join([
        f"## Text: {section['num_samples']:,} review-like documents, words tokenizer cut to {section['max_length']} "
        f"tokens, batch {config['batch_size']}", "", section["table"], "",
        f"Rows other than the raw files: the median of {config['process_repeats']} fresh processes.",
        f"Padding share of [B, T] cells: random batches {padding['random']:.1%}, bucketed {padding['bucketed']:.1%}. "
        "Conversion: " + ", ".join(f"{fmt} {c['docs_per_s']:,.0f} docs/s" for fmt, c in section["conversion"].items())
        + ".",
    ])


def peers_text(section, config):
    versions = ", ".join(f"{name} {version or 'not installed'}" for name, version in section["versions"].items())
    return "\n".join([f"## Other tools ({section['num_samples']:,} samples of uint8 [3, {section['size']}, "
                      f"{section['size']}], batch {config['batch_size']}, shuffled)", "", section["table"], "",
                      f"Versions: {versions}."])


def sweeps_text(section, config):
    from benchmarks.sections import sweeps

    parts = [f"## Sweeps ({section['num_samples']:,} images at {section['size']}x{section['size']}; samples/s)"]
    for name, points in section["sweeps"].items():
        parts += ["", f"### {name}", "", sweep_table(name, points)]
    summary = section["summary"]
    if summary:
        lines = [f"- {fmt}: best {s['best_samples_per_s']:,.0f}/s at num_workers={s['best_num_workers']}; within "
                 f"{1 - sweeps.HELP_FRACTION:.0%} of it from num_workers={s['stops_helping_from_num_workers']}; "
                 + (f"below {sweeps.HURT_FRACTION:.0%} of it from num_workers={s['hurts_from_num_workers']}"
                    if s["hurts_from_num_workers"] is not None else
                    f"never below {sweeps.HURT_FRACTION:.0%} of it after") for fmt, s in summary.items()]
        parts += ["", *lines]
    parts += [f"\n{note}" for note in section["notes"]]
    return "\n".join(parts)


def sweep_table(name, points):
    """Return a table with one line per (format, fixed settings) and one column per value of ``name``."""
    fixed = [key for key in ("num_workers", "batch_size", "prefetch_factor", "pin_memory") if key != name]
    lines, values = {}, sorted({p[name] for p in points})
    for p in points:
        label = (p["format"], *(f"{k}={p[k]}" for k in fixed if k != "pin_memory" or name == "pin_memory"))
        lines.setdefault(label, {})[p[name]] = p["samples_per_s"]
    body = [(label[0], ", ".join(label[1:]), *(f"{rates[v]:,.0f}" if v in rates else "" for v in values))
            for label, rates in lines.items()]
    return markdown_table(["format", "fixed", *(f"{name}={v}" for v in values)], body, "ll" + "r" * len(values))


def memory_text(section, config):
    return "\n".join([f"## Worker memory over one epoch ({section['num_samples']:,} samples, "
                      f"{section['num_workers']} workers, batch {config['batch_size']})", "", section["table"], "",
                      "Per worker, mean over the workers. Start: once every worker has delivered a batch. Private "
                      "dirty: pages a worker copied or allocated; USS and PSS also count file pages it mapped (page "
                      "cache, shared with the kernel and the other worker; the kernel maps 64 KB around each fault, "
                      "so the first batches map most of a small file). Packed samples: "
                      + section["packed_sample"] + "."])


def coldcache_text(section, config):
    notes = "; ".join(section["notes"]) or "none"
    return "\n".join([f"## Cold cache (first epoch after dropping the files' pages; {section['size']}x"
                      f"{section['size']})", "", section["table"], "",
                      f"Page-cache drop: {', '.join(section['drop_methods'])}; notes: {notes}."])


_RENDERERS = (("images", images_text), ("gpustep", gpustep_text), ("text", text_text), ("peers", peers_text),
              ("sweeps", sweeps_text), ("memory", memory_text), ("coldcache", coldcache_text),
              *[(name, lambda section, config: section["text"])  # these sections write their own
                for name in ("shards", "scale", "augment", "fusedcrop", "training", "streaming", "busystep",
                             "records", "lm", "lmscale")])


# ---------------------------------------------------------------- files


def write(results, out_dir, plots=True):
    """Write results.json, results.md and the plots into ``out_dir``; return the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "results.json"), os.path.join(out_dir, "results.md")]
    with open(paths[0], "w") as f:
        json.dump(results, f, indent=2, default=_jsonable)
    with open(paths[1], "w") as f:
        f.write(results["markdown"])
    if plots:
        from benchmarks import plots as plotting

        written, note = plotting.draw(results, out_dir)
        paths += written
        if note:
            print(note, file=sys.stderr)
    return paths


def _jsonable(value):
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
