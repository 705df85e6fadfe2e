"""How much prefill work this EPP has queued on each endpoint that the endpoint has probably not done yet.

In-flight prompt tokens count a long prompt until its request finishes, long after its prefill; the scraped
queue is up to 50 ms old and says nothing of prompt lengths. A request that lands behind a 5,000-token prefill
waits for it, one that lands after it does not, and that difference is most of a short request's TTFT error. So
each endpoint gets a fluid queue: every request routed there adds its uncached prompt tokens, and the queue drains
at the prefill rate while it is not empty. The rate is learnt from the requests that found their endpoint's
queue empty and had a long prompt (their TTFT is almost all their own prefill): an exponentially weighted mean of
seconds per token, starting from 0.1 ms (an 8B model on one H100; only a prior, replaced within ~20 such requests).

On the sim pool (`python -m harness.bench.prediction --phase 30`, 4 servers, one run each before and after, same
seed) the TTFT MAPE at 24 clients went from 19.1 % to 7.2 % when routed by the prediction (--route predicted),
and from 29.9 % to 28.5 % with random routing, where requests keep landing behind long prefills that no feature
can rule out.
Endpoints of different speeds (an InferencePool selecting pods on two GPU generations): each endpoint also keeps
its own rate from the samples it served (their mean, with the pool's rate as one sample, then the weighted mean),
its queue drains at it, and its `slowness`, its rate over the mean of the endpoints' own rates (steadier than the
pool's recent samples, which follow wherever the last long prompts went), scales the predictions there: the
predictor learns in units of that mean and multiplies back. Only such clean
samples teach it: a long prompt that found nothing ahead measures the GPU, while a ratio of observed to predicted
latency also measures whatever the model misses about an endpoint's traffic, and an endpoint that a high factor
keeps requests from keeps it (tried: such a factor per endpoint spread the multi-lora workload's requests 0 to 117
per server in two runs, where the pool's model alone spread them 53 to 63). Without long prompts every endpoint runs
at the pool's rate.
Trade-offs: the queue assumes first-come-first-served prefill at the endpoint's rate, and knows only this EPP's
traffic (several EPP replicas or direct clients each see part of it; the scraped counts still see all). One
slowness scales a whole TTFT prediction, the decode steps a short prompt waits for included: a GPU generation is
slower at both, though not always by the same factor.
"""

from __future__ import annotations

DEFAULT_SECONDS_PER_TOKEN = 1e-4
LONG_PROMPT_TOKENS = 1000  # rate samples: own prefill long enough that fixed per-step costs are a small part
RATE_WEIGHT = 0.1  # of each new sample in the mean (an endpoint's: once it has 1 / RATE_WEIGHT - 1 samples)
MAX_IDLE_ENTRIES = 4096  # endpoints whose queue has drained are forgotten beyond this many entries
MAX_RATES = 4096  # endpoints with a rate of their own (the oldest goes first beyond it; `forget` at pool changes)


class PrefillBacklog:
    def __init__(self) -> None:
        self.seconds_per_token = DEFAULT_SECONDS_PER_TOKEN  # the pool's
        # endpoint name -> (tokens, time.monotonic() then); read directly by LatencyPredictor.predict_endpoints
        self.queues: dict[str, tuple[float, float]] = {}
        # endpoint name -> [its seconds per token, samples learnt]; read directly by predict_endpoints
        self.rates: dict[str, list[float]] = {}
        self._reference: float | None = None  # the mean of the rates, until they change

    def rate(self, name: str) -> float:
        """Seconds per uncached prompt token on endpoint `name` (the pool's until it has a sample)."""
        entry = self.rates.get(name)
        return self.seconds_per_token if entry is None else entry[0]

    @property
    def reference(self) -> float:
        """The mean of the endpoints' own rates (the pool's rate while none has one)."""
        if self._reference is None:
            rates = self.rates
            self._reference = sum(e[0] for e in rates.values()) / len(rates) if rates else self.seconds_per_token
        return self._reference

    def slowness(self, name: str) -> float:
        """Endpoint `name`'s prefill time per token over the reference (1 until it has a sample)."""
        entry = self.rates.get(name)
        return 1.0 if entry is None else entry[0] / self.reference

    def measured_slowness(self) -> dict[str, float]:
        """Every measured endpoint's slowness. Safe from another thread (the metrics scrape's): list() copies
        the rates in one C call under the GIL, so the event loop adding one meanwhile cannot break the reading."""
        rates = list(self.rates.items())
        if not rates:
            return {}
        reference = sum(entry[0] for _, entry in rates) / len(rates)
        return {name: entry[0] / reference for name, entry in rates}

    def tokens(self, name: str, now: float) -> float:
        """Prefill tokens still queued on endpoint `name` at `now`."""
        queue = self.queues.get(name)
        if queue is None:
            return 0.0
        tokens, then = queue
        left = tokens - (now - then) / self.rate(name)
        return left if left > 0.0 else 0.0

    def add(self, name: str, tokens: float, now: float) -> float:
        """Queue a request's uncached prompt tokens on `name`; returns what was queued ahead of them."""
        ahead = self.tokens(name, now)
        queues = self.queues
        if name not in queues and len(queues) >= MAX_IDLE_ENTRIES:
            for drained in [n for n in queues if self.tokens(n, now) == 0.0]:
                del queues[drained]
        queues[name] = (ahead + tokens, now)
        return ahead

    def learn(self, name: str, uncached_tokens: int, ahead: float, ttft: float) -> None:
        """One completed request on endpoint `name` (\"\" when unknown): a rate sample, for the pool and the
        endpoint, when it had a long prompt and found (almost) nothing ahead."""
        if uncached_tokens < LONG_PROMPT_TOKENS or ahead > 0.1 * uncached_tokens:
            return
        sample = ttft / uncached_tokens
        if name:
            rates = self.rates
            entry = rates.get(name)
            if entry is None:
                if len(rates) >= MAX_RATES:
                    del rates[next(iter(rates))]
                entry = rates[name] = [self.seconds_per_token, 0]
            entry[1] += 1
            entry[0] += max(RATE_WEIGHT, 1.0 / (entry[1] + 1)) * (sample - entry[0])
            self._reference = None
        self.seconds_per_token += RATE_WEIGHT * (sample - self.seconds_per_token)

    def forget(self, keep: set[str]) -> None:
        """Drop the rates of endpoints not in `keep` (the pool's members now): one that comes back is measured
        again."""
        for name in [n for n in self.rates if n not in keep]:
            del self.rates[name]
        self._reference = None
