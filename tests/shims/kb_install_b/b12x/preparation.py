"""Stand-in for b12x.preparation (flashinfer 0.7.2): plans, requests, prepare_default.

As in the real package: a plan carries its prepared state once prepared; prepare_default
materializes it, runs the request's prepare call (which may bind inputs) and primes the returned
call once; a plan used unprepared is materialized with a no-op prepare call (b12x's lazy
default), so nothing is bound."""

from dataclasses import dataclass
from typing import Callable


@dataclass
class PreparedCall:
    run: Callable[[], object]
    output: object = None


class Request:
    def __init__(self, plan, name, prepare_call):
        self.plan, self.name, self.prepare_call = plan, name, prepare_call


class Plan:
    def __init__(self, query, runtime, make_state):
        self.query, self.runtime, self._make_state, self._prepared = query, runtime, make_state, None

    def request(self, *, name, prepare_call, **_):
        return Request(self, name, prepare_call)


def prepare_default(request):
    plan = request.plan
    state = plan._make_state()
    call = request.prepare_call(state)
    call.run()  # priming
    plan._prepared = state
    return state


def require_prepared(plan):
    if plan._prepared is None:  # the lazy default: a no-op prepare call
        plan._prepared = prepare_default(Request(plan, "default", lambda state: PreparedCall(run=lambda: None)))
    return plan._prepared
