"""This process's mappings as /proc/self/smaps describes them. Standard library only, so that a serving process
started by a test can import it without importing anything of the build (``sys.path`` holding tests/)."""

from __future__ import annotations


def smaps_entry(address: int) -> dict[str, list[str]]:
    """The smaps entry of the mapping of this process that holds ``address``: each field's values by name
    (``"VmFlags"``, ``"Rss"`` in kB, ``"FilePmdMapped"``: kB mapped in 2 MiB pages, ...)."""
    entry: dict[str, list[str]] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                if entry is not None:
                    return entry
                start, end = (int(x, 16) for x in fields[0].split("-"))
                entry = {} if start <= address < end else None
            elif entry is not None:
                entry[fields[0].rstrip(":")] = fields[1:]
    if entry is None:
        raise AssertionError(f"no mapping holds {address:#x}")
    return entry


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (``rr``: read at random; ``hg``: huge
    pages asked for)."""
    return smaps_entry(address)["VmFlags"]
