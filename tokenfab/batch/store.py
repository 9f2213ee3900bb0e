"""BatchStore: uploaded files, batch jobs and their per-line results, and stored responses (the
Responses API's `store`), durable under one data dir.

    data_dir/batch.sqlite   files, batches, results, responses (the standard library's sqlite3, WAL mode)
    data_dir/files/<id>     each file's bytes (uploads and the output/error files a batch writes)

Every line's result is one committed row keyed by (batch, line) and inserted with INSERT OR IGNORE, so
a restart that runs the lines without a row cannot produce a second result for any line: that is the
whole crash-durability argument. `synchronous=FULL` makes a commit survive power loss as well as a
killed process. Objects come back as the dicts OpenAI's API returns (`file`, `batch`).

A `batch.sqlite` that is not SQLite (corrupt, or some other file), or SQLite whose tables are not these
(another program's database), is refused when the store opens, with a StoreOpenError naming the file:
the server must not start on it, and must not write into it.
"""
from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
from pathlib import Path

# OpenAI's own limits: 200 MB per batch input file, 50,000 requests per batch.
DEFAULT_MAX_FILE_BYTES = 200 << 20
DEFAULT_MAX_TOTAL_BYTES = 10 << 30
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
COMPLETION_WINDOW_S = 24 * 3600

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, status TEXT NOT NULL, obj TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, is_error INTEGER NOT NULL, record TEXT NOT NULL,
    PRIMARY KEY (batch_id, line));
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, obj TEXT NOT NULL, input_items TEXT NOT NULL);
"""


class StoreError(ValueError):
    """A request the store refuses; `status` is the HTTP status it maps to."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


# The columns of each table, in order, as _SCHEMA creates them: what an existing file must hold.
_COLUMNS = {"files": ["id", "filename", "purpose", "bytes", "created_at"],
            "batches": ["seq", "id", "status", "obj"],
            "results": ["batch_id", "line", "is_error", "record"],
            "responses": ["seq", "id", "obj", "input_items"]}


class StoreOpenError(ValueError):
    """The data dir's database cannot be used: not SQLite, or another program's tables."""


def _check_tables(db: sqlite3.Connection, path: Path) -> None:
    """Before anything is written: every table present must be one of ours, with our columns."""
    tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                       "AND name NOT LIKE 'sqlite_%' ORDER BY name")]
    strangers = [t for t in tables if t not in _COLUMNS]
    if strangers:
        raise StoreOpenError(f"{path} is not a tokenfab batch store: it holds tables ({', '.join(strangers)}) "
                             "tokenfab never creates; it belongs to something else. Move it aside, or pass "
                             "another --data-dir")
    for table in tables:
        want = _COLUMNS[table]
        got = [row[1] for row in db.execute(f"PRAGMA table_info({table})")]
        if got != want:
            raise StoreOpenError(f"{path} is not a tokenfab batch store: its table {table!r} has columns "
                                 f"{', '.join(got)} where tokenfab expects {', '.join(want)}; it belongs to "
                                 "something else. Move it aside, or pass another --data-dir")


class BatchStore:
    def __init__(self, data_dir: str | os.PathLike, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES) -> None:
        self.dir = Path(data_dir)
        self.files_dir = self.dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.max_file_bytes, self.max_total_bytes = max_file_bytes, max_total_bytes
        self._lock = threading.Lock()
        path = self.dir / "batch.sqlite"
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            _check_tables(self._db, path)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as e:
            self._db.close()
            raise StoreOpenError(f"{path} is not a tokenfab batch store: SQLite says {e!s}. Move it aside (or "
                                 "restore it from a backup), or pass another --data-dir") from None
        except StoreOpenError:
            self._db.close()
            raise

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _q(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- files ---------------------------------------------------------------------------------
    def add_file(self, filename: str, purpose: str, data: bytes, file_id: str | None = None,
                 limited: bool = True) -> dict:
        """Store a file; `limited=False` for a batch's own output, which must not fail at its end."""
        if limited and len(data) > self.max_file_bytes:
            raise StoreError(413, f"the file is {len(data)} bytes but the limit is {self.max_file_bytes} "
                                  "(raise it with --batch-max-file-bytes)", "file_too_large", "file")
        used = self.total_bytes()
        if limited and used + len(data) > self.max_total_bytes:
            raise StoreError(413, f"storing {len(data)} more bytes would exceed the total of "
                                  f"{self.max_total_bytes} bytes ({used} in use); delete files with "
                                  "DELETE /v1/files/{id} or raise --batch-max-total-bytes", "storage_full", "file")
        file_id = file_id or f"file-{uuid.uuid4().hex}"
        path = self.files_dir / file_id
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:         # written and synced before its row exists: no row without bytes
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._q("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?)",
                (file_id, filename, purpose, len(data), int(time.time())))
        return self.get_file(file_id)

    def get_file(self, file_id: str) -> dict:
        rows = self._q("SELECT id, filename, purpose, bytes, created_at FROM files WHERE id = ?", (file_id,))
        if not rows:
            raise StoreError(404, f"no file with id {file_id!r}", "file_not_found", "file_id")
        fid, name, purpose, size, created = rows[0]
        return {"id": fid, "object": "file", "bytes": size, "created_at": created, "filename": name,
                "purpose": purpose, "status": "processed", "status_details": None, "expires_at": None}

    def list_files(self, purpose: str | None = None) -> list[dict]:
        ids = self._q("SELECT id FROM files WHERE ? IS NULL OR purpose = ? ORDER BY created_at DESC", (purpose, purpose))
        return [self.get_file(i) for (i,) in ids]

    def file_content(self, file_id: str) -> bytes:
        self.get_file(file_id)
        return (self.files_dir / file_id).read_bytes()

    def delete_file(self, file_id: str) -> dict:
        self.get_file(file_id)
        self._q("DELETE FROM files WHERE id = ?", (file_id,))
        (self.files_dir / file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    def total_bytes(self) -> int:
        return self._q("SELECT COALESCE(SUM(bytes), 0) FROM files")[0][0]

    # -- batches -------------------------------------------------------------------------------
    def create_batch(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict | None, model: str | None = None) -> dict:
        now = int(time.time())
        obj = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": endpoint, "errors": None,
               "input_file_id": input_file_id, "completion_window": completion_window, "status": "validating",
               "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
               "expires_at": now + COMPLETION_WINDOW_S, "finalizing_at": None, "completed_at": None,
               "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
               "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata, "model": model}
        self._q("INSERT INTO batches (id, status, obj) VALUES (?, ?, ?)", (obj["id"], obj["status"], json.dumps(obj)))
        return obj

    def get_batch(self, batch_id: str) -> dict:
        rows = self._q("SELECT obj FROM batches WHERE id = ?", (batch_id,))
        if not rows:
            raise StoreError(404, f"no batch with id {batch_id!r}", "batch_not_found", "batch_id")
        obj = json.loads(rows[0][0])
        if obj["status"] in ACTIVE:       # live counts while it runs; frozen into obj once it ends
            obj["request_counts"].update(self.counts(batch_id))
        return obj

    def update_batch(self, batch_id: str, **fields) -> dict:
        """Set fields (a new `status` stamps its `<status>_at` time) and return the object."""
        obj = self.get_batch(batch_id)
        obj.update(fields)
        stamp = f"{fields.get('status')}_at"
        if stamp in obj and obj[stamp] is None:
            obj[stamp] = int(time.time())
        self._q("UPDATE batches SET status = ?, obj = ? WHERE id = ?", (obj["status"], json.dumps(obj), batch_id))
        return obj

    def list_batches(self, limit: int = 20, after: str | None = None) -> tuple[list[dict], bool]:
        """Newest first, OpenAI's cursor: `after` is the last id of the previous page."""
        start = 1 << 62
        if after is not None:
            rows = self._q("SELECT seq FROM batches WHERE id = ?", (after,))
            if not rows:
                raise StoreError(400, f"after: no batch with id {after!r}", "invalid_cursor", "after")
            start = rows[0][0]
        ids = self._q("SELECT id FROM batches WHERE seq < ? ORDER BY seq DESC LIMIT ?", (start, limit + 1))
        return [self.get_batch(i) for (i,) in ids[:limit]], len(ids) > limit

    def active_batches(self) -> list[dict]:
        marks = ",".join("?" * len(ACTIVE))
        return [self.get_batch(i) for (i,) in self._q(f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY seq", ACTIVE)]

    # -- per-line results ----------------------------------------------------------------------
    def add_result(self, batch_id: str, line: int, record: dict, is_error: bool) -> bool:
        """Commit one line's result; False (and nothing changes) when that line already has one."""
        with self._lock:
            cur = self._db.execute("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?)",
                                   (batch_id, line, int(is_error), json.dumps(record)))
            return cur.rowcount == 1

    def done_lines(self, batch_id: str) -> set[int]:
        return {n for (n,) in self._q("SELECT line FROM results WHERE batch_id = ?", (batch_id,))}

    def counts(self, batch_id: str) -> dict:
        ok, bad = self._q("SELECT COALESCE(SUM(1 - is_error), 0), COALESCE(SUM(is_error), 0) FROM results "
                          "WHERE batch_id = ?", (batch_id,))[0]
        return {"completed": ok, "failed": bad}

    def results(self, batch_id: str) -> list[tuple[int, bool, str]]:
        """(line, is_error, record as JSON text), in input order."""
        return [(n, bool(e), r) for n, e, r in
                self._q("SELECT line, is_error, record FROM results WHERE batch_id = ? ORDER BY line", (batch_id,))]

    # -- stored responses (/v1/responses with store: true) -----------------------------------------
    def add_response(self, obj: dict, input_items: list[dict]) -> None:
        """Keep a finished response with every input item it saw (a previous response's included)."""
        self._q("INSERT INTO responses (id, obj, input_items) VALUES (?, ?, ?)",
                (obj["id"], json.dumps(obj), json.dumps(input_items)))

    def get_response(self, response_id: str, param: str = "response_id") -> tuple[dict, list[dict]]:
        """(the response object, its input items); a 404 naming `param` when no response has that id."""
        rows = self._q("SELECT obj, input_items FROM responses WHERE id = ?", (response_id,))
        if not rows:
            raise StoreError(404, f"no stored response with id {response_id!r} (it was never stored, was created "
                                  "with store: false, or was deleted)", "response_not_found", param)
        return json.loads(rows[0][0]), json.loads(rows[0][1])

    def delete_response(self, response_id: str) -> dict:
        self.get_response(response_id)
        self._q("DELETE FROM responses WHERE id = ?", (response_id,))
        return {"id": response_id, "object": "response.deleted", "deleted": True}
