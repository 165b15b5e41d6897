"""A process's Python stacks, read from one of its threads while the others run: what is kept
of a rank found hung, a straggler replaced (``parallel/phases.py``) and a read that does not
return (``data/reads.py``). No torch, no Ray: read tasks and ranks both call it."""

from __future__ import annotations

import threading


def stacks(training_thread: int = 0) -> dict:
    """Every thread's Python stack in this process, read from the calling thread
    (``sys._current_frames``: the threads are not stopped): ``threads``, the training thread's
    first, each {"name", "ident", "frames": [{"file", "line", "function"}, ... innermost last]};
    ``top``: the innermost frame of the training thread (or of the first thread); ``text``:
    the whole of it as a traceback."""
    import sys
    import traceback

    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    frames = {ident: f for ident, f in sys._current_frames().items() if ident != me}
    order = sorted(frames, key=lambda ident: (ident != training_thread, names.get(ident, "")))
    threads, text = [], []
    for ident in order:
        summary = traceback.extract_stack(frames[ident])
        name = names.get(ident, f"thread {ident}") + (" (training)" if ident == training_thread else "")
        threads.append({"name": name, "ident": ident,
                        "frames": [{"file": f.filename, "line": f.lineno, "function": f.name} for f in summary]})
        text.append(f"Thread {name}:\n" + "".join(traceback.format_list(summary)))
    top = threads[0]["frames"][-1] if threads and threads[0]["frames"] else {}
    return {"threads": threads, "top": top, "text": "\n".join(text)}
