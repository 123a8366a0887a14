"""What both sides speak, below the server and the worker side alike (imports nothing of ours but errors;
no torch): an edit's parameters as declared (`params.py`: `Param`, the one parser by kind), the request
whose fields declare them (`request.py`: `EditRequest`, `PARAMETERS`), the states (`states.py`), and what a
request becomes and what comes back (`results.py`: `Resolved`, `EditResult`, the statuses). Every name is
imported from here: `from imgedit.protocol import EditRequest`.
"""

from imgedit.protocol.params import (
    BATCH,
    EDIT,
    EVERYWHERE,
    JOBS,
    REST,
    SINGLE,
    Number,
    Param,
    declaration,
    declared,
)
from imgedit.protocol.request import (
    PARAMETERS,
    EditRequest,
    Picture,
    as_declared,
    as_ran,
    group,
    new_request_id,
    param,
    parameters,
    request_kwargs,
)
from imgedit.protocol.results import EditResult, JobRecord, ManagerStatus, Progress, Resolved, WorkerStatus
from imgedit.protocol.states import ItemState, JobState, WorkerState

__all__ = ["BATCH", "EDIT", "EVERYWHERE", "JOBS", "PARAMETERS", "REST", "SINGLE", "EditRequest",
           "EditResult", "ItemState", "JobRecord", "JobState", "ManagerStatus", "Number", "Param",
           "Picture", "Progress", "Resolved", "WorkerState", "WorkerStatus", "as_declared", "as_ran",
           "declaration", "declared", "group", "new_request_id", "param", "parameters", "request_kwargs"]
