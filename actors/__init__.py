"""The Ray runtime: MasterActor, ExpertManager, PlacementService, transports."""
