"""Window slots: a batch of a wanted window waits for the slot it will take, however that slot is held now."""

import threading

import numpy as np

from fastdata.reading.windowslots import RUN, Window, WindowSlots


def held(key, start, stop, reading):
    """Return window ``key`` placed, holding global samples ``start..stop`` at view rows from 0, its reads under
    way where ``reading``."""
    window = Window(key)
    runs = np.zeros(1, RUN)
    runs["start"], runs["stop"] = start, stop
    window.set_runs(runs)
    window.placed = True
    window.expect(1 if reading else 0)
    return window


def lease_on_a_thread(slots, indices):
    """Start ``slots.lease(indices)`` on a thread; return the thread and the list its answer goes in."""
    answer = []
    thread = threading.Thread(target=lambda: answer.append(slots.lease(indices)), daemon=True)
    thread.start()
    return thread, answer


def place_next(slots, start, stop):
    """Do the placing thread's work once: take the next wanted window's slot and put it there, holding
    ``start..stop``."""
    slot, key = slots.next_placement()
    slots.put(slot, held(key, start, stop, reading=False))


def test_a_batch_of_the_window_wanted_next_waits_for_the_reads_that_hold_its_slot_to_end():
    slots = WindowSlots()
    slots.windows = [held((0, 0), 0, 1, reading=True), held((0, 1), 1, 2, reading=True)]
    slots.want([(0, 2), (0, 3)])  # both let go, neither read yet: no slot is free until a read ends
    thread, answer = lease_on_a_thread(slots, np.array([2], np.int64))
    thread.join(0.5)
    assert thread.is_alive() and not answer  # answered now, the batch would be read from the files
    slots.windows[0].finish_one()
    slots.notify()
    place_next(slots, 2, 3)
    thread.join(5)
    rows, used = answer[0]
    assert rows.tolist() == [0] and [window.key for window in used] == [(0, 2)]


def test_a_batch_not_in_a_window_that_can_be_placed_is_answered_at_once():
    slots = WindowSlots()
    slots.windows = [held((0, 0), 0, 1, reading=False), held((0, 1), 1, 2, reading=True)]
    slots.windows[0].leases = 1  # a batch still holds it: its slot is not freed by reads ending
    slots.windows[1].leases = 1
    slots.want([(0, 2), (0, 3)])
    thread, answer = lease_on_a_thread(slots, np.array([2], np.int64))
    thread.join(5)
    assert answer == [(None, [])]


def test_a_batch_wanted_in_a_slot_whose_reads_end_after_stop_is_answered_at_stop():
    slots = WindowSlots()
    slots.windows = [held((0, 0), 0, 1, reading=True), held((0, 1), 1, 2, reading=True)]
    slots.want([(0, 2), (0, 3)])
    thread, answer = lease_on_a_thread(slots, np.array([2], np.int64))
    thread.join(0.2)
    slots.stop()
    thread.join(5)
    assert answer == [(None, [])]
