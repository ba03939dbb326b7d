"""Proves that the reference pages are complete and invent nothing: docs/configuration.md has a row
for every config key fencegate reads and none for a key it does not; docs/errors.md names every
error code fencegate's error renderers define and none they do not.

The keys come from the binary itself: `fencegate check-config` prints the effective config as
TOML, a key not set as a comment (`# admin_token: not set`), which is read into dotted keys. The codes come from the source of the error renderers.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from fencegate_testlib import bin_path

REPO_ROOT = Path(__file__).resolve().parents[2]
SHIPPED_CONFIG = REPO_ROOT / "config" / "fencegate.toml"
CONFIGURATION_MD = REPO_ROOT / "docs" / "configuration.md"
ERRORS_MD = REPO_ROOT / "docs" / "errors.md"

# --------------------------------------------------------------------------------------------
# config keys: docs/configuration.md against `fencegate check-config`
# --------------------------------------------------------------------------------------------

# Added to the shipped config (as its FENCEGATE_INCLUDE), so that the arrays of tables print one
# entry each and with it their keys: an empty array prints as `[]`, with no key inside.
WITH_EVERY_TABLE = """
[[credentials]]
access_key_id = "docs-reference"
secret_access_key = "docs-reference-secret"
buckets = ["reports"]

[[fencing.rules]]
bucket = "reports"
prefix = "2026/"
resource = "reports/2026/"

[[routes]]
prefix = "/payments/"
upstream = "https://api.example.com/v1/payments/"
resource = "payment:{1}"
mode = "idempotency-key"
"""

# The stores and upstreams other than the shipped ones, so that keys printed only for a kind
# of store or upstream are seen too.
SHARED_STORES = {
    "redis": 'kind = "redis"\nurl = "redis://127.0.0.1:6379"',
    "etcd": 'kind = "etcd"\nendpoints = ["http://127.0.0.1:2379"]',
}
S3_UPSTREAM = """
[upstream]
kind = "s3"
endpoint = "http://127.0.0.1:9100"
access_key_id = "upstream-key"
secret_access_key = "upstream-secret"
probe_bucket = "reports"
"""

def shown_paths(text: str) -> set:
    """The dotted keys of check-config's TOML: `key = value` lines and `# key: not set` comments
    (TOML has no null), under the `[table]` or `[[array.of.tables]]` header they follow."""
    paths, table = set(), ""
    for line in text.splitlines():
        header = re.match(r"^\[\[?([a-z0-9_.]+)\]\]?$", line)
        key = re.match(r"^([a-z0-9_]+) = ", line) or re.match(r"^# ([a-z0-9_]+): not set$", line)
        if header:
            table = header.group(1)
            paths.add(table)
        elif key:
            paths.add(f"{table}.{key.group(1)}" if table else key.group(1))
    return paths


def leaf_keys(paths) -> set:
    """The keys a user sets: a path with keys under it (`server`, `credentials`) is a table."""
    paths = set(paths)
    return {p for p in paths if not any(other.startswith(p + ".") for other in paths)}


def printed_keys(config: Path, include: Path, tmp_path: Path) -> set:
    """The keys of the effective config `fencegate check-config` prints for `config`."""
    r = subprocess.run([str(bin_path()), "check-config", "--config", str(config)], cwd=tmp_path,
                       env={"FENCEGATE_INCLUDE": str(include), "PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"check-config failed:\n{r.stdout}\n{r.stderr}"
    tomllib.loads(r.stdout)  # a file serve reads: it must parse
    return leaf_keys(shown_paths(r.stdout))


def documented_keys() -> set:
    """The keys named in the first cell of the rows of docs/configuration.md's tables."""
    keys = set()
    for line in CONFIGURATION_MD.read_text().splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            keys.update(re.findall(r"`([a-z0-9_]+(?:\.[a-z0-9_]+)+)`", first_cell))
    return keys


def every_printed_key(tmp_path: Path) -> set:
    include = tmp_path / "tables.toml"
    include.write_text(WITH_EVERY_TABLE)
    keys = printed_keys(SHIPPED_CONFIG, include, tmp_path)
    shipped = SHIPPED_CONFIG.read_text()
    for kind, store in SHARED_STORES.items():
        shared = re.sub(r"\[store\]\n.*?(?=\n\[)", lambda _m: "[store]\n" + store + "\n", shipped, flags=re.S)
        shared = re.sub(r"\[upstream\]\n.*?(?=\n\[)", lambda _m: S3_UPSTREAM.strip() + "\n", shared, flags=re.S)
        assert f'kind = "{kind}"' in shared and 'kind = "s3"' in shared, shared
        config = tmp_path / f"{kind}.toml"
        config.write_text(shared)
        keys |= printed_keys(config, include, tmp_path)
    return keys


def test_the_toml_reader_reads_every_shape():
    """The reader's own check: keys, keys not set, tables, arrays of tables, risk comments."""
    text = """routes = []
# domain: not set

[[credentials]]
access_key_id = "a = b"
secret_access_key = "<hidden: credentials.secret_access_key>"

[fencing]
rules = []

[[fencing.rules]]
bucket = "b"

[server]
# admin_token: not set
listen = "127.0.0.1:9000"
# risk: server.listen is reachable
"""
    assert leaf_keys(shown_paths(text)) == {"routes", "domain", "credentials.access_key_id",
                                            "credentials.secret_access_key", "fencing.rules.bucket",
                                            "server.admin_token", "server.listen"}


def test_the_configuration_page_documents_every_key_and_no_other(tmp_path):
    """Every key fencegate prints has a row in docs/configuration.md, and every row names a key
    fencegate prints: a key added to the config structs without a row fails this, and so does a
    row left behind for a key that is gone."""
    printed = every_printed_key(tmp_path)
    documented = documented_keys()
    assert len(printed) > 50, sorted(printed)  # the parse found the config, not a fragment of it
    undocumented = sorted(printed - documented)
    invented = sorted(documented - printed)
    assert undocumented == [], f"config keys without a row in docs/configuration.md: {undocumented}"
    assert invented == [], f"rows of docs/configuration.md for keys fencegate does not have: {invented}"


# --------------------------------------------------------------------------------------------
# error codes: docs/errors.md against the error renderers
# --------------------------------------------------------------------------------------------

# The files that turn errors into responses, and whether each must define codes of its own (a
# file that moved, or stopped matching the pattern below, fails loudly rather than dropping its
# codes).
ERROR_SOURCES = {
    "src/refusal.rs": True,  # the fencing protocol's refusals, both fronts
    "src/s3/error.rs": True,  # the S3 front's errors, as S3 XML
    "src/gateway/error.rs": True,  # the API gateway's errors, as problem+json
    "src/net/problem.rs": False,  # the problem+json document; its codes come from its callers
    "src/lease/mod.rs": True,  # leases and registrations on the S3 listener
    "src/admin/mod.rs": True,  # the admin API
    "src/admin/views.rs": True,  # the operator's listings
    "src/admin/events.rs": True,  # the feed of decisions
}

# A code is a string literal of one capitalised word (`"FencingTokenStale"`, `"SlowDown"`) that
# either follows a status in a (status, code) pair, as the renderers write them:
#     (S::CONFLICT, "FencingTokenStale")      problem(StatusCode::GONE, "LeaseGone", ...)
# or is what a match arm returns, as `Refusal::code` and `Refusal::s3_code` write them:
#     Self::Stale { .. } => "FencingTokenStale",
# (metric labels, also returned by match arms, are snake_case and so never match). A file's unit
# tests (from its `#[cfg(test)]` on) are not read: their codes are examples.
ERROR_CODE_RE = re.compile(r'(?:\b(?:StatusCode|S)::[A-Z_]+,\s*|=>\s*)"([A-Z][A-Za-z0-9]*)"')

# The last section of docs/errors.md lists codes fencegate does not define itself (the S3
# library's and the upstream's); its codes must not be fencegate's own.
NOT_OURS_HEADING = "## Answered by the S3 library or the upstream"


def defined_codes() -> set:
    codes = set()
    for source, defines_codes in ERROR_SOURCES.items():
        path = REPO_ROOT / source
        assert path.is_file(), f"{source} is gone: point ERROR_SOURCES at where its errors are rendered now"
        code = path.read_text().split("#[cfg(test)]", 1)[0]
        found = set(ERROR_CODE_RE.findall(code))
        assert found or not defines_codes, f"{source} defines no code that ERROR_CODE_RE reads: update the pattern"
        codes |= found
    return codes


def code_column_codes(markdown: str) -> set:
    """The backticked codes in the `code` column of the markdown's tables."""
    codes, column = set(), None
    for line in markdown.splitlines():
        if not line.startswith("|"):
            column = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if column is None:  # a table's header row
            column = cells.index("code") if "code" in cells else -1
        elif column >= 0 and not set(cells[0]) <= set("-: "):
            codes.update(re.findall(r"`([A-Z][A-Za-z0-9]*)`", cells[column]))
    return codes


def documented_codes() -> tuple:
    """(fencegate's own codes, the codes of the last section) as docs/errors.md lists them."""
    text = ERRORS_MD.read_text()
    assert NOT_OURS_HEADING in text, f"docs/errors.md has no section {NOT_OURS_HEADING!r}"
    ours, not_ours = text.split(NOT_OURS_HEADING, 1)
    return code_column_codes(ours), code_column_codes(not_ours)


def test_the_error_code_pattern_reads_both_shapes():
    """The pattern's own check: the two shapes it reads, and a metric label it must not."""
    sample = '''
        Self::Stale { .. } => "FencingTokenStale",
        Self::Stale { .. } => "stale",
        Self::KeyReused => (S::UNPROCESSABLE_ENTITY, "IdempotencyKeyReused"),
        _ => problem(StatusCode::NOT_FOUND, "NotFound", "no such admin endpoint"),
        tracing::info!("Fenced");
    '''
    assert set(ERROR_CODE_RE.findall(sample)) == {"FencingTokenStale", "IdempotencyKeyReused", "NotFound"}


def test_the_errors_page_names_every_code_and_no_other():
    """Every code the error renderers define is in a table of docs/errors.md, and every code
    those tables name (but the last section's) is defined there; the last section's are not."""
    defined = defined_codes()
    ours, not_ours = documented_codes()
    assert "FencingTokenStale" in defined and len(defined) > 30, sorted(defined)
    assert sorted(defined - ours) == [], f"error codes missing from docs/errors.md: {sorted(defined - ours)}"
    assert sorted(ours - defined) == [], f"docs/errors.md names codes fencegate does not define: {sorted(ours - defined)}"
    assert not_ours and sorted(not_ours & defined) == [], (
        f"codes fencegate defines, listed under {NOT_OURS_HEADING!r}: {sorted(not_ours & defined)}")


@pytest.mark.parametrize("page", ["docs/configuration.md", "docs/errors.md"])
def test_the_reference_pages_are_linked_from_the_readme(page):
    """A newcomer finds both pages from the front door."""
    assert f"({page})" in (REPO_ROOT / "README.md").read_text(), f"README.md does not link {page}"
