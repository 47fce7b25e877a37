"""Synthetic datasets for demos, tests and benchmarks (nothing is downloaded).

Images look like photos to a JPEG codec: smooth colour fields, a few hard
edged shapes and sensor-like noise, so file sizes and decode times are those
of real photos (about 30-60 KB at 500x375, quality 90).

Reviews look like IMDB reviews to a tokenizer: a Zipf-distributed vocabulary
of a few thousand words, sentiment words that depend on the label, mixed
case, punctuation, contractions, ``<br /><br />`` paragraph breaks and a
long-tailed length (median ~200 words).
"""

import csv
import json
import os
import shutil

import numpy as np
from PIL import Image, ImageDraw


def make_photo(rng, width=500, height=375):
    """Return a photo-like RGB PIL image drawn from ``rng``."""
    field = rng.integers(0, 256, size=(4, 5, 3), dtype=np.uint8)
    img = Image.fromarray(field, "RGB").resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(rng.integers(3, 8)):
        x0, y0 = rng.integers(0, width), rng.integers(0, height)
        x1, y1 = x0 + rng.integers(1, max(2, width // 2)), y0 + rng.integers(1, max(2, height // 2))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=colour)
    pixels = np.asarray(img, dtype=np.int16) + rng.normal(0, 6, (height, width, 3)).astype(np.int16)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


# (extension, mode) of make_imagefolder(vary=True): two in three images are JPEGs, as in real photo folders.
_JPEG_KINDS = ((".jpg", "RGB"), (".jpg", "L"), (".jpg", "RGB"), (".jpg", "CMYK"))
_OTHER_KINDS = (
    (".png", "RGBA"),
    (".png", "I;16"),
    (".bmp", "RGB"),
    (".tiff", "CMYK"),
    (".gif", "P"),
    (".webp", "RGB"),
    (".png", "P"),
    (".tiff", "L"),
)


def make_imagefolder(root, num_classes=4, per_class=25, size=(500, 375), seed=0, quality=90, vary=False,
                     jpeg_only=False):
    """Write an ImageFolder tree ``root/class_k/img_j.<ext>``; return ``root``.

    Every image is a ``size`` (width, height) RGB JPEG, or with ``vary``
    images of varied sizes (a quarter to four times ``size``'s area) and
    aspect ratios (1:4 to 4:1): index j of each class is a JPEG (RGB, L or
    CMYK) unless j % 3 == 1, which cycles through PNG (RGBA, 16-bit, P), BMP,
    TIFF (CMYK, L), GIF and WebP. With ``jpeg_only`` as well, every image is
    a JPEG of varied size and mode, as in a folder of camera photos.
    """
    rng = np.random.default_rng(seed)
    others = 0
    for label in range(num_classes):
        folder = os.path.join(root, f"class_{label}")
        os.makedirs(folder, exist_ok=True)
        for index in range(per_class):
            if not vary:
                make_photo(rng, *size).save(os.path.join(folder, f"img_{index:05d}.jpg"), "JPEG", quality=quality)
                continue
            if index % 3 == 1 and not jpeg_only:
                ext, mode = _OTHER_KINDS[others % len(_OTHER_KINDS)]
                others += 1
            else:
                ext, mode = _JPEG_KINDS[index % len(_JPEG_KINDS)]
            img = _in_mode(make_photo(rng, *_varied_size(rng, size)), mode)
            img.save(os.path.join(folder, f"img_{index:05d}{ext}"), **({"quality": quality} if ext == ".jpg" else {}))
    return os.fspath(root)


def make_imagenet_like(root, num_images, classes=1000, distinct=3000, seed=0, quality=90):
    """Write an ImageNet-like ImageFolder of ``num_images`` varied JPEGs, mostly hard links; return ``root``.

    ``distinct`` photo-like JPEGs of ImageNet's shapes (``_imagenet_size``:
    mean about 500x400, aspect ratios 1:2 to 2:1, four in five landscape;
    eight in ten RGB, one L, one CMYK) are written once, then linked as
    ``root/class_kkkk/img_jjjjj.jpg``, spread evenly over ``classes``
    folders. See NOTE [linked photos].
    """
    if not 1 <= classes <= num_images or distinct < 1:
        raise ValueError(f"need 1 <= classes <= num_images and distinct >= 1, got classes={classes}, "
                         f"num_images={num_images}, distinct={distinct}")
    root, rng = os.fspath(root), np.random.default_rng(seed)
    pool = root + ".distinct"  # a sibling, so that the tree holds nothing but its classes
    os.makedirs(pool, exist_ok=True)
    sources = []
    for index in range(min(distinct, num_images)):
        sources.append(os.path.join(pool, f"photo_{index:05d}.jpg"))
        img = make_photo(rng, *_imagenet_size(rng))
        img.convert(_IMAGENET_MODES[index % len(_IMAGENET_MODES)]).save(sources[-1], "JPEG", quality=quality)
    counts = np.bincount(np.arange(num_images) % classes, minlength=classes)
    number = 0
    for label, count in enumerate(counts.tolist()):
        folder = os.path.join(root, f"class_{label:04d}")
        os.makedirs(folder)
        for index in range(count):
            os.link(sources[number % len(sources)], os.path.join(folder, f"img_{index:05d}.jpg"))
            number += 1
    shutil.rmtree(pool)  # the links keep the files
    return root


_IMAGENET_MODES = ("RGB",) * 8 + ("L", "CMYK")


def _imagenet_size(rng):
    """Return a ``(width, height)``: area 90,000-360,000 pixels, 4:3 times 2/3 to 3/2, turned one time in ten."""
    area, ratio = 180_000 * 2 ** rng.uniform(-1, 1), 4 / 3 * 1.5 ** rng.uniform(-1, 1)
    if rng.random() < 0.1:
        ratio = 1 / ratio
    return max(1, round((area * ratio) ** 0.5)), max(1, round((area / ratio) ** 0.5))


# NOTE [linked photos]: drawing and encoding one varied photo takes 17 ms
# (200 in 3.4 s on this 2-core machine), so 200,000 distinct ones would take
# an hour; a hard link takes 20 us (20,000 in 0.41 s). A converter opens each
# link as its own file, so its decode and resize work is that of 200,000
# photos; only the page cache is kinder than with real photos (a few
# thousand distinct files, ~200 MB, stay cached).


def _varied_size(rng, size):
    """Return a ``(width, height)`` of 1/4 to 4x the area of ``size``, aspect ratio 1:4 to 4:1."""
    area = size[0] * size[1] * 4 ** rng.uniform(-1, 1)
    ratio = 4 ** rng.uniform(-1, 1)
    return max(1, round((area * ratio) ** 0.5)), max(1, round((area / ratio) ** 0.5))


def _in_mode(img, mode):
    """Return the RGB ``img`` in ``mode``; "P" gets a transparent palette entry, "RGBA" a soft alpha."""
    if mode == "I;16":
        return Image.fromarray(np.asarray(img.convert("L"), np.uint16) * 257)
    if mode == "P":
        img = img.quantize(64)
        img.info["transparency"] = 0
        return img
    if mode == "RGBA":
        alpha = np.linspace(64, 255, img.width, dtype=np.uint8)[None].repeat(img.height, 0)
        return Image.fromarray(np.dstack([np.asarray(img), alpha]), "RGBA")
    return img.convert(mode)


# NOTE [learnable images]: class k is a shape (k % 5: disc, bar, triangle,
# cross, ring) in a colour family (k // 5: warm, cool, green, violet hues), at
# a random position, scale (50-80% of the shorter side) and rotation inside
# the image's central square, so a centre crop keeps it; the background is a
# desaturated photo-like field with a few thin lines of any hue and sensor
# noise. The mean colour alone does not give the class: with 10 classes x 60
# images (seed 0, validated on seed 1) a logistic regression on each image's
# mean RGB reaches 0.31 and least squares 0.22 (chance 0.10); the training
# example's small ResNet reaches > 0.9 (see examples/train_resnet.py).
_SHAPES = ("disc", "bar", "triangle", "cross", "ring")
_HUES = ((-0.06, 0.14), (0.50, 0.68), (0.25, 0.40), (0.74, 0.90))  # warm, cool, green, violet (0..1 turns)
# (extension, mode) of the learnable images: kinds that keep the colour (no greyscale, no transparency).
_COLOUR_KINDS = ((".jpg", "RGB"), (".png", "RGB"), (".jpg", "CMYK"), (".webp", "RGB"),
                 (".jpg", "RGB"), (".png", "P"), (".bmp", "RGB"), (".tiff", "CMYK"))


def make_learnable_imagefolder(root, num_classes=10, per_class=100, seed=0, sides=(40, 200), quality=90):
    """Write an ImageFolder ``root/<shape>_<colour>/img_j.<ext>`` whose class a small CNN can learn; return ``root``.

    The class decides the shape and the colour family of one object drawn on
    a noisy photo-like background (see NOTE [learnable images]). Each side of
    an image is drawn from ``sides`` (so aspect ratios run up to 1:5), and
    the files cycle through JPEG (RGB, CMYK), PNG (RGB, P), WebP, BMP and
    TIFF. Deterministic for a ``seed``.

    Args:
        root: folder to write (created).
        num_classes: 1 to 20 classes: shape kind x colour family.
        per_class: images per class.
        seed: seed of every random draw.
        sides: smallest and largest image side in pixels.
        quality: JPEG and WebP quality.

    Returns:
        ``root`` as a str.

    Example:
        >>> make_learnable_imagefolder("shapes/train", per_class=100, seed=0)
        >>> make_learnable_imagefolder("shapes/val", per_class=30, seed=1)
    """
    if not 1 <= num_classes <= len(_SHAPES) * len(_HUES):
        raise ValueError(f"num_classes should be in 1..{len(_SHAPES) * len(_HUES)}, got num_classes={num_classes}")
    if not 16 <= sides[0] <= sides[1]:
        raise ValueError(f"sides should be (smallest, largest) with 16 <= smallest <= largest, got sides={sides}")
    rng = np.random.default_rng(seed)
    for label in range(num_classes):
        folder = os.path.join(root, learnable_class_name(label))
        os.makedirs(folder, exist_ok=True)
        for index in range(per_class):
            width, height = (int(side) for side in rng.integers(sides[0], sides[1] + 1, 2))
            img = _draw_learnable(rng, label, width, height)
            ext, mode = _COLOUR_KINDS[(label + index) % len(_COLOUR_KINDS)]
            img = img.quantize(64) if mode == "P" else img.convert(mode)
            img.save(os.path.join(folder, f"img_{index:05d}{ext}"), **({"quality": quality} if ext in (
                ".jpg", ".webp") else {}))
    return os.fspath(root)


def learnable_class_name(label):
    """Return the folder name of class ``label`` of make_learnable_imagefolder, e.g. ``"03_cross_warm"``."""
    family = ("warm", "cool", "green", "violet")[label // len(_SHAPES)]
    return f"{label:02d}_{_SHAPES[label % len(_SHAPES)]}_{family}"


def _draw_learnable(rng, label, width, height):
    """Return one RGB image of class ``label``: its shape in its colour family on a noisy background."""
    field = rng.integers(0, 256, size=(3, 4, 3)).astype(np.float32)
    field = 0.4 * field + 0.6 * field.mean(axis=2, keepdims=True)  # desaturated: the object owns the colour
    field = 128 + 0.7 * (field - 128)
    img = Image.fromarray(field.astype(np.uint8), "RGB").resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(rng.integers(0, 3)):  # thin distractor lines of any hue
        points = [tuple(int(v) for v in rng.integers(0, (width, height))) for _ in range(2)]
        draw.line(points, fill=_colour(rng, rng.random()), width=int(rng.integers(1, 3)))
    side = min(width, height)
    radius = side * rng.uniform(0.25, 0.4)
    centre = np.array([width, height]) / 2 + rng.uniform(-1, 1, 2) * (side / 2 - radius)
    low, high = _HUES[label // len(_SHAPES)]
    _draw_shape(draw, _SHAPES[label % len(_SHAPES)], centre, radius, rng.uniform(0, 2 * np.pi),
                _colour(rng, rng.uniform(low, high) % 1.0))
    pixels = np.asarray(img, dtype=np.float32) + rng.normal(0, rng.uniform(3, 12), (height, width, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def _colour(rng, hue):
    """Return a saturated RGB colour of ``hue`` (0..1 turns) with a random saturation and value."""
    hsv = np.array([[[hue * 255, rng.uniform(150, 255), rng.uniform(150, 255)]]], dtype=np.uint8)
    return tuple(int(c) for c in np.asarray(Image.fromarray(hsv, "HSV").convert("RGB"))[0, 0])


def _draw_shape(draw, shape, centre, radius, angle, colour):
    """Draw ``shape`` of ``radius`` (pixels) around ``centre`` (x, y), turned by ``angle`` radians."""
    x, y = centre
    if shape in ("disc", "ring"):
        box = (x - radius, y - radius, x + radius, y + radius)
        draw.ellipse(box, fill=colour if shape == "disc" else None, outline=colour,
                     width=0 if shape == "disc" else max(2, round(radius * 0.35)))
        return
    if shape == "bar":  # a 4:1 rectangle
        outline = np.array([(1, 0.25), (-1, 0.25), (-1, -0.25), (1, -0.25)])
    elif shape == "triangle":
        outline = np.array([(np.cos(a), np.sin(a)) for a in np.arange(3) * 2 * np.pi / 3])
    else:  # cross: a plus sign whose arms are a quarter of its width
        t = 1 / 4
        outline = np.array([(t, 1), (-t, 1), (-t, t), (-1, t), (-1, -t), (-t, -t), (-t, -1), (t, -1), (t, -t),
                            (1, -t), (1, t), (t, t)])
    turn = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    points = outline @ turn.T * radius + (x, y)
    draw.polygon([tuple(p) for p in points.tolist()], fill=colour)


_FUNCTION_WORDS = (
    "the a and of to is in it this that was as with for but on movie film not you are his have be one all at "
    "by an who they from so like her just about out if has what some there can more when very even my would "
    "she which only really see story their had we me well were than much been get do also into how its will"
).split()
_SENTIMENT_WORDS = {
    "pos": "great excellent wonderful loved best beautiful brilliant perfect superb enjoyable fun touching".split(),
    "neg": "bad worst awful boring terrible waste poor stupid horrible dull mess disappointing".split(),
}
_CONTRACTIONS = ("don't", "it's", "didn't", "can't", "isn't", "I'm", "wasn't", "you'll")
_SYLLABLES = "ka ro mi ten sa lo ver dan ith on pre ul gra sto bel mer tic al ry ne".split()


def _lexicon(size=4000, seed=1234):
    """Return ``size`` distinct made-up words, the same for every call."""
    rng = np.random.default_rng(seed)
    words, seen = [], set(_FUNCTION_WORDS)
    while len(words) < size:
        word = "".join(rng.choice(_SYLLABLES, rng.integers(1, 4)))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return _FUNCTION_WORDS + words


_LEXICON = None


def make_review(rng, label=None):
    """Return one review-like text drawn from ``rng``; ``label`` "pos", "neg" or None."""
    global _LEXICON
    if _LEXICON is None:
        words = _lexicon()
        ranks = np.arange(1, len(words) + 1)
        _LEXICON = (np.array(words, dtype=object), np.cumsum(1 / ranks**1.05) / np.sum(1 / ranks**1.05))
    words, cdf = _LEXICON
    sentiment = _SENTIMENT_WORDS.get(label, _SENTIMENT_WORDS["pos"] + _SENTIMENT_WORDS["neg"])
    num_words = int(np.clip(rng.lognormal(np.log(200), 0.6), 8, 1500))
    drawn = words[np.minimum(np.searchsorted(cdf, rng.random(num_words)), len(words) - 1)]
    sentences, sentence = [], []
    for i, word in enumerate(drawn):
        roll = rng.random()
        if roll < 0.04:
            word = sentiment[rng.integers(len(sentiment))]
        elif roll < 0.05:
            word = _CONTRACTIONS[rng.integers(len(_CONTRACTIONS))]
        sentence.append(word.capitalize() if not sentence else word)
        if rng.random() < 0.06 and len(sentence) > 2:
            sentence[-1] += ","
        if len(sentence) >= 6 and rng.random() < 0.12 or i == len(drawn) - 1:
            sentences.append(" ".join(sentence) + "!?."[min(2, rng.integers(0, 8))])
            sentence = []
    paragraphs, start = [], 0
    while start < len(sentences):
        stop = start + int(rng.integers(2, 8))
        paragraphs.append(" ".join(sentences[start:stop]))
        start = stop
    return "<br /><br />".join(paragraphs)


def make_reviews(num_samples, seed=0, classes=("neg", "pos")):
    """Return ``(texts, labels)``: review-like texts and their label names, alternating."""
    rng = np.random.default_rng(seed)
    labels = [classes[i % len(classes)] for i in range(num_samples)]
    return [make_review(rng, label) for label in labels], labels


def make_text_corpus(root, per_class=25, num_unsup=0, seed=0, splits=("train",)):
    """Write an IMDB-like tree ``root/<split>/{neg,pos,unsup}/<id>_<rating>.txt``; return ``root``.

    ``unsup`` (unlabeled, rating 0) is written for the "train" split only,
    when ``num_unsup > 0``.
    """
    rng = np.random.default_rng(seed)
    for split in splits:
        folders = [("neg", per_class), ("pos", per_class)]
        if split == "train" and num_unsup:
            folders.append(("unsup", num_unsup))
        for label, count in folders:
            folder = os.path.join(root, split, label)
            os.makedirs(folder, exist_ok=True)
            for index in range(count):
                rating = {"neg": rng.integers(1, 5), "pos": rng.integers(7, 11)}.get(label, 0)
                text = make_review(rng, label if label != "unsup" else None)
                with open(os.path.join(folder, f"{index}_{rating}.txt"), "w", encoding="utf-8") as f:
                    f.write(text)
    return os.fspath(root)


def write_text_file(path, texts, labels=None, *, text_field="text", label_field="label"):
    """Write ``texts`` (and ``labels``) as CSV, TSV, JSON Lines or plain lines, by extension; return ``path``.

    Plain text files (any other extension) get one text per line, without labels.
    """
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    rows = list(zip(texts, labels if labels is not None else [None] * len(texts)))
    if ext in (".csv", ".tsv"):
        with open(path, "w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f, delimiter="\t" if ext == ".tsv" else ",")
            writer.writerow([text_field] + ([label_field] if labels is not None else []))
            writer.writerows([text] + ([label] if labels is not None else []) for text, label in rows)
    elif ext in (".jsonl", ".ndjson"):
        with open(path, "w", encoding="utf-8") as f:
            for text, label in rows:
                record = {text_field: text} if labels is None else {text_field: text, label_field: label}
                f.write(json.dumps(record) + "\n")
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(" ".join(text.splitlines()) + "\n" for text in texts)
    return path
