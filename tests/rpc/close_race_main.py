"""Child for test_guarded_channel: starts calls on a channel while closing it.

`python close_race_main.py guarded|raw [secret]`: "guarded" opens the channel
the way kdist does (`Security.channel`), "raw" a bare `grpc.insecure_channel`
(the negative control, expected to crash grpc). Prints "survived" and exits 0
when every thread ended with one of the errors a closed channel gives.
"""

import sys
import threading

import grpc

from kdist.rpc.security import Security
from tests.rpc.echo_fixture import SERVICE, EchoServer

THREADS = 8
METHODS_PER_THREAD = 50


def main(mode, secret=None):
    security = Security(token=secret) if secret else Security.insecure()
    server = EchoServer(security)
    target = f"127.0.0.1:{server.port}"
    channel = security.channel(target) if mode == "guarded" else grpc.insecure_channel(target)
    # One call first, so the channel is connected and the server proved itself.
    assert channel.unary_unary(f"/{SERVICE}/Unary", _registered_method=True)(b"x", timeout=10) == b"x"
    start = threading.Barrier(THREADS + 1)
    outcomes = []

    def caller(index):
        start.wait()
        for number in range(METHODS_PER_THREAD):
            # A method never registered before: its first call registers it on the channel.
            method = f"/{SERVICE}/Missing{index}_{number}"
            try:
                channel.unary_unary(method, _registered_method=True)(b"x", timeout=10)
            except ValueError:  # grpc's "Cannot invoke RPC on closed channel!"
                outcomes.append("closed")
                return
            except grpc.RpcError as error:  # UNIMPLEMENTED while open, CANCELLED at the close
                outcomes.append(error.code().name)
        outcomes.append("finished")

    threads = [threading.Thread(target=caller, args=(index,)) for index in range(THREADS)]
    for thread in threads:
        thread.start()
    start.wait()
    channel.close()
    # After the close, a first call of a new method on the same channel.
    try:
        channel.unary_unary(f"/{SERVICE}/AfterClose", _registered_method=True)(b"x", timeout=10)
    except ValueError:
        pass
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive(), "a caller hung on the closed channel"
    channel.close()  # a second close is harmless
    server.stop()
    print("outcomes:", sorted(set(outcomes)))
    print("survived")


if __name__ == "__main__":
    main(*sys.argv[1:])
