"""CSV/TSV files read row by row, each row with its line number, and an unmatched quote found.

NOTE [unmatched quotes]: a quote that is never closed makes the csv module
read every following line into one field, up to the next quote character or
the end of the file (a 1,000-row file once became 510 rows in one sample and
0 skipped). A record spanning lines is taken for such a quote when the quote
is still open at the end of the file, or when the record is not valid CSV
(read strictly: the closing quote is followed by more text, as when it is
the opening quote of a later row) and each line strictly inside it (the
second line, for a record of two lines) reads on its own as a whole row (as
many fields as the header, non-empty text and label; blank lines aside).
Its first line is then skipped with the reason and reading resumes on its
second line, so the rows it swallowed are kept. A CSV writer's output is
valid, so its texts spanning lines are never taken apart.
"""

import csv
import os
from contextlib import contextmanager

from fastdata.errors import SourceError

_MAX_FIELD = 2**31 - 1  # the csv module's field limit is a C long (32 bits on Windows)


def read_rows(path, delimiter, text_field, label_field):
    """Yield ``(line number, {column: value} or None, reason or None)`` per row of a CSV/TSV file.

    Blank lines are no rows. A row that cannot be used comes with the reason
    (not readable as CSV, an unmatched quote, more fields than the header);
    a row short of fields lacks them in its dict.

    Raises:
        SourceError: no header row, a header without ``text_field`` or
            ``label_field``, or naming one twice.
    """
    # surrogateescape keeps bad bytes apart so one bad row is skipped, not the whole file.
    with open(path, encoding="utf-8-sig", errors="surrogateescape", newline="") as f, _field_limit(path):
        table = _Table(f, delimiter)
        columns = _check_header(path, table.header(path), text_field, label_field)
        for first, taken, row, reason in table.records():
            if table.open_at_end or (len(taken) > 1 and _swallowed_rows(taken, delimiter, columns)):
                table.reread(taken[1:])  # see NOTE [unmatched quotes]
                row, reason = None, _unmatched_quote_reason(first, taken, table.open_at_end)
            if row is None and reason is None:
                continue  # a blank line
            reason = reason or columns.check_width(row)
            yield first, (dict(zip(columns.names, row)) if reason is None else None), reason


@contextmanager
def _field_limit(path):
    # The csv module refuses fields over 128 KiB; none can be larger than the file itself.
    old = csv.field_size_limit()
    csv.field_size_limit(max(old, min(os.path.getsize(path) + 1, _MAX_FIELD)))
    try:
        yield
    finally:
        csv.field_size_limit(old)


class _Table:
    """Records of a CSV file with the physical lines each was read from, and lines put back to read again."""

    def __init__(self, f, delimiter):
        self._lines = enumerate(f, 1)
        self._again = []  # (number, line) to read before the file's next line
        self._taken = []  # (number, line) read for the record in progress
        self.open_at_end = False  # the file ended inside the record in progress: a quote was open
        self._reader = csv.reader(self._next_lines(), delimiter=delimiter)

    def _next_line(self):
        item = self._again.pop() if self._again else next(self._lines, None)
        if item is not None:
            self._taken.append(item)
        return item

    def _next_lines(self):
        while (item := self._next_line()) is not None:
            yield item[1]
        self.open_at_end = bool(self._taken)

    def _take_rest_of_quote(self):
        """After an error inside a record, take lines until its quotes pair up: the record's likely end."""
        quotes = sum(line.count('"') for _, line in self._taken)
        while quotes % 2 and (item := self._next_line()) is not None:
            quotes += item[1].count('"')

    def header(self, path):
        """Return the first row that is not blank, or ``[]``."""
        for first, _, row, reason in self.records():
            if self.open_at_end:
                reason = f"unmatched quote starting at line {first} (still open at the end of the file)"
            if reason is not None:
                raise SourceError(f"{path!r}: the header row is not readable: {reason}")
            if row:
                return row
        return []

    def records(self):
        """Yield ``(first line number, [(number, line)], row or None, reason or None)`` per record."""
        while True:
            self._taken, self.open_at_end = [], False
            try:
                row, reason = next(self._reader), None
            except StopIteration:
                if not self._again:
                    return
                self._reader = csv.reader(self._next_lines(), delimiter=self._reader.dialect.delimiter)
                continue
            except csv.Error as exc:
                self._take_rest_of_quote()
                row, reason = None, f"not readable as CSV: {exc}{_lines_note(self._taken)}"
            if self._taken:
                yield self._taken[0][0], self._taken, (row or None), reason

    def reread(self, items):
        """Read ``items`` (``(number, line)``) again before the next line of the file."""
        self._again.extend(reversed(items))


def _lines_note(taken):
    return f" (lines {taken[0][0]}-{taken[-1][0]})" if len(taken) > 1 else ""


def _unmatched_quote_reason(first, taken, open_at_end):
    last = taken[-1][0]
    reason = f"unmatched quote starting at line {first} "
    reason += "(still open at the end of the file)" if open_at_end else f"(closed on line {last})"
    if last == first + 1:
        return reason + f"; line {last} read as a row instead"
    return reason + (f"; lines {first + 1}-{last} read as rows instead" if last > first else "")


def _swallowed_rows(taken, delimiter, columns):
    """Whether a record spanning lines is an unmatched quote (see NOTE [unmatched quotes])."""
    inner = [line for _, line in taken[1:-1] if line.strip()] or [taken[-1][1]]  # two lines: the second
    if columns.width < 2 or _is_valid_csv([line for _, line in taken], delimiter):
        return False  # one column: every line reads as a row; only a quote open at the end is found
    return all(columns.is_row(next(csv.reader([line], delimiter=delimiter), [])) for line in inner)


def _is_valid_csv(lines, delimiter):
    try:
        list(csv.reader(lines, delimiter=delimiter, strict=True))
    except csv.Error:
        return False
    return True


class _Columns:
    """The header of a CSV file: its names and where the text and label are."""

    def __init__(self, names, text_field, label_field):
        self.names, self.width = names, len(names)
        self._text = names.index(text_field) if text_field in names else None
        self._label = names.index(label_field) if label_field in names else None

    def is_row(self, row):
        """Whether ``row`` is whole: as wide as the header, with a text and a label (or every field)."""
        if len(row) != self.width:
            return False
        needed = row if self._label is None else [row[self._text], row[self._label]]
        return all(value.strip() for value in needed)

    def check_width(self, row):
        """Return why a row with more fields than the header cannot be used, or None."""
        if row is None or len(row) <= self.width or not any(value.strip() for value in row[self.width:]):
            return None
        return (f"{len(row)} fields where the header has {self.width} "
                "(a delimiter in an unquoted text? quote the text)")


def _check_header(path, header, text_field, label_field):
    if not header:
        raise SourceError(f"{path!r} is empty; expected a header row naming the columns")
    for option, column in (("text_field", text_field), ("label_field", label_field)):
        if column is not None and column not in header:
            extra = " or label_field=None (--no-labels)" if option == "label_field" else ""
            raise SourceError(f"{path!r} has no column {column!r} (columns: {header}); "
                              f"pass {option}= (--{option.replace('_', '-')}){extra}")
        if column is not None and header.count(column) > 1:
            raise SourceError(f"{path!r} has {header.count(column)} columns named {column!r}; rename all but one")
    return _Columns(header, text_field, label_field)
