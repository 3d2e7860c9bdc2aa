"""A machine profile's YAML with its measured tables (GEMM, attention, collectives) as files to write into one
folder, every table named by a path relative to the YAML beside it: a run folder that carries its profile and
a profile that `refit` writes can both be moved without breaking. Text only; the caller writes the files."""
from __future__ import annotations

from pathlib import Path

import yaml

from axoplan.errors import UserError

# the profile's sections that may name a measured table (machine_profiles/README.md)
TABLES = (("compute", "gemm"), ("compute", "attention"), ("network", "intra_node"))


def with_tables(d: dict, src_yaml: Path, dest_dir: Path, prefix: str = "") -> tuple[dict, dict[str, tuple[bytes, int]]]:
    """(the profile mapping with its table paths relative to dest_dir, {file name: (bytes, mode)} of the tables to
    write there). A table already in dest_dir stays where it is; one elsewhere is copied in under prefix + its name,
    so a table never replaces another of the same name."""
    d = yaml.safe_load(yaml.safe_dump(d))  # a deep copy
    files: dict[str, tuple[bytes, int]] = {}
    dest_dir = dest_dir.resolve()
    for section, sub in TABLES:
        tab = ((d.get(section) or {}).get(sub) or {}).get("table")
        if not (isinstance(tab, dict) and isinstance(tab.get("path"), str)):
            continue
        p = Path(tab["path"])
        p = (p if p.is_absolute() else src_yaml.parent / p).resolve()
        if p.parent == dest_dir:
            tab["path"] = p.name
            continue
        try:
            data = p.read_bytes()
        except OSError as e:
            raise UserError(f"cannot read the profile's table '{p}': {(e.strerror or str(e)).lower()}") from None
        name = f"{prefix}{p.name}"
        files[name] = (data, 0o644)
        tab["path"] = name
    return d, files


def profile_files(profile, name: str, dest_dir: Path) -> dict[str, tuple[str | bytes, int]]:
    """The files that put `profile` (read from a YAML file) into dest_dir as `name`, its tables beside it."""
    if not profile.path:
        raise UserError(f"machine '{profile.name}' was not read from a YAML file, so it cannot be copied")
    src = Path(profile.path)
    try:
        d = yaml.safe_load(src.read_text())
    except OSError as e:
        raise UserError(f"cannot read the machine profile '{src}': {(e.strerror or str(e)).lower()}") from None
    d, tables = with_tables(d, src, dest_dir, prefix=f"{Path(name).stem}_")
    text = (f"# Machine profile '{profile.name}' copied here by axoplan, so this folder is complete\n"
            + yaml.safe_dump(d, sort_keys=False))
    return {name: (text, 0o644), **tables}
