"""The worker: claimer, segment runner, lease keeper, waker and drain."""
