"""The customer-facing clients: ServiceClient, TrainingClient, SamplingClient, RestClient."""

from treadle.client.rest import RestClient
from treadle.client.sampling import SamplingClient
from treadle.client.service import ServiceClient
from treadle.client.training import TrainingClient

__all__ = ["RestClient", "SamplingClient", "ServiceClient", "TrainingClient"]
