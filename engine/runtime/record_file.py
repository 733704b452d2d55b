"""One JSON file of measured records under the engine's cache: `{"format": 1, SECTION: {key: record}}`.

The measured splits (measured_split.py) and the measured weight layouts (measured_layout.py) are
each one such file: a record per key, a newer measurement on the same key replacing the older one.
A write goes whole to a temporary file that is then renamed, so a reader never sees half of one.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

FORMAT = 1


class RecordFile:
    """The records of one `section` in the JSON file at `path`; `what` names the file in errors."""

    def __init__(self, path: Path, section: str, what: str) -> None:
        self.path = Path(path)
        self.section = section
        self.what = what

    def read(self) -> dict:
        """The whole document (an empty one when the file does not exist yet)."""
        if not self.path.is_file():
            return {"format": FORMAT, self.section: {}}
        try:
            doc = json.loads(self.path.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{self.what} file {self.path} is unreadable ({err}); delete it to start over") from err
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get(self.section), dict):
            raise ValueError(f"{self.what} file {self.path} is not format {FORMAT}; delete it to start over")
        return doc

    def records(self) -> dict:
        """The section's records, key -> record."""
        return self.read()[self.section]

    def get(self, key: str) -> object | None:
        return self.records().get(key)

    def put(self, key: str, record: dict) -> None:
        """Keep `record` under `key`, replacing an older one."""
        doc = self.read()
        doc[self.section][key] = record
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.stem}.")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)
