"""One request to each of several parameter servers, answered together.

`started` serves the calls of a training step (pull, lookup, push): every
request is sent from the calling thread, then every answer read there, so
the servers work on them at once and no thread hands anything over (a
handoff per call cost a worker more CPU than the calls' own Python code).
`pooled` runs blocking calls on a thread pool: the calls made once a job
(create, configure, optimizer state) that have no two-halves form.
"""


def started(clients, requests, start):
    """`{ps_index: payload}` -> `{ps_index: result}`, the calls in flight together from this thread.

    Args:
        clients: the `VariableClient` of each server, by index.
        requests: ps index -> what `start` sends there.
        start: `start(client, payload)` sends a request and returns its
            `finish()` (`VariableClient.start_pull`, `start_lookup`, `start_push`).

    Every call that was sent is read to its end (each has its deadline)
    before the first error, if any, is raised.
    """
    finishes, results, failure = [], {}, None
    for ps_index, payload in requests.items():
        try:
            finishes.append((ps_index, start(clients[ps_index], payload)))
        except Exception as error:
            failure = error
            break
    for ps_index, finish in finishes:
        try:
            results[ps_index] = finish()
        except Exception as error:
            failure = failure or error
    if failure is not None:
        raise failure
    return results


def pooled(pool, clients, requests, call):
    """`{ps_index: payload}` -> `{ps_index: call(client, payload)}`, the calls run concurrently on `pool`."""
    if len(requests) == 1:
        ((ps_index, payload),) = requests.items()
        return {ps_index: call(clients[ps_index], payload)}
    futures = {ps_index: pool.submit(call, clients[ps_index], payload) for ps_index, payload in requests.items()}
    return {ps_index: future.result() for ps_index, future in futures.items()}
