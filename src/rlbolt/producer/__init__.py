"""The producer: what makes each step's experience while the main thread trains.

    producer.py        Producer: the stage threads (feeder, rollout, logps, reward, advantage) around
                       an ExperienceDock, and the consumer side the Trainer iterates (ProducedStep)
    stage_threads.py   StageThreads: starting, stopping and polling the stage threads; a stage's
                       error handed to the main thread with that stage's frames
    handoff.py         what a producer hook may return: columns added, none rewritten; the shares of
                       a round gathered across processes
    weights.py         WeightStore: the weights the producer may roll out with (sync / async lag)
    dock/              ExperienceDock: the column store between stages (docs/dock.md)
    sequential.py      SequentialProducer: the same step in one thread, the data flow's runnable
                       specification the pipeline equals bit for bit

Nothing here is needed to write a module or a callback; `Trainer.fit` runs it.
"""

from rlbolt.producer.producer import STAGE_INPUTS, STAGE_ROLES, ProducedStep, Producer, sample_keys
from rlbolt.producer.weights import WeightStore

__all__ = ["STAGE_INPUTS", "STAGE_ROLES", "ProducedStep", "Producer", "WeightStore", "sample_keys"]
