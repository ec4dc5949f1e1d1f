"""What several test files do alike: write traces, and read them back with no gpumem code involved
(so that what gpumem reports is checked against an independent count)."""

import gzip

HEADER = '# action addr size stream  (test; {"workload": "t"})'


def write_bytes(path, data: bytes, compress=True):
    """data to path, gzipped when compress; returns path."""
    if compress:
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


def write_text(path, lines, compress=True, header=HEADER):
    """A text trace: the header line (none if empty), then lines."""
    body = "\n".join(([header] if header else []) + list(lines)) + "\n"
    return write_bytes(path, body.encode(), compress)


def raw_events(path):
    """(action, addr, size, stream) of a gzipped text trace, read line by line."""
    out = []
    with gzip.open(path, "rt") as f:
        for line in f:
            if not line.startswith("#"):
                a, addr, size, stream = line.split()
                out.append((a, int(addr), int(size), int(stream)))
    return out


def live_by_event(events):
    """Live bytes before the first event and after each alloc or free_completed of
    (action, addr, size, stream) tuples; the other actions leave no entry."""
    live, out, sizes = 0, [0], {}
    for action, addr, size, _ in events:
        if action == "alloc":
            live += size
            sizes[addr] = size
        elif action == "free_completed":
            live -= sizes.pop(addr)
        else:
            continue
        out.append(live)
    return out


def recount_peak(events):
    """Peak of live bytes of (action, addr, size, stream) tuples."""
    return max(live_by_event(events))
