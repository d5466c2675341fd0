"""The GraphQL documents the webserver test and the deployment tests send to Dagster's webserver,
and the statuses at which a backfill or a run is over."""

from __future__ import annotations


TERMINAL_BACKFILL = {"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"}


TERMINAL_RUN = {"SUCCESS", "FAILURE", "CANCELED"}


ASSET_NODES = """
query AssetNodes {
  assetNodes {
    assetKey { path }
    groupName
    isPartitioned
    isMaterializable
    isObservable
    jobNames
    partitionDefinition { type name }
    backfillPolicy { policyType maxPartitionsPerRun }
  }
}
"""


REPOSITORY = """
query Repository($selector: RepositorySelector!) {
  repositoryOrError(repositorySelector: $selector) {
    __typename
    ... on Repository {
      jobs { name }
      sensors { name sensorState { status } }
      schedules { name scheduleState { status } }
    }
    ... on Error { message }
  }
}
"""


ADD_PARTITION = """
mutation AddPartition($name: String!, $key: String!, $selector: RepositorySelector!) {
  addDynamicPartition(partitionsDefName: $name, partitionKey: $key, repositorySelector: $selector) {
    __typename
    ... on AddDynamicPartitionSuccess { partitionsDefName partitionKey }
    ... on Error { message }
    ... on PythonError { stack }
  }
}
"""


PARTITIONS = """
query Partitions($key: AssetKeyInput!) {
  assetNodeOrError(assetKey: $key) {
    __typename
    ... on AssetNode {
      partitionKeys
      partitionKeysByDimension { name type partitionKeys }
      partitionStats { numMaterialized numPartitions numFailed numMaterializing }
      assetPartitionStatuses {
        __typename
        ... on DefaultPartitionStatuses {
          materializedPartitions failedPartitions unmaterializedPartitions materializingPartitions
        }
      }
    }
    ... on AssetNotFoundError { message }
  }
}
"""


# What the UI's partition view asks for (AssetPartitionDetail): the partition's events, newest first.
PARTITION_EVENTS = """
query PartitionEvents($key: AssetKeyInput!, $partition: String!) {
  assetOrError(assetKey: $key) {
    ... on Asset {
      assetEventHistory(partitions: [$partition], limit: 1000, eventTypeSelectors: [MATERIALIZATION, OBSERVATION]) {
        results {
          __typename
          ... on MaterializationEvent { timestamp metadataEntries { label } }
          ... on ObservationEvent { timestamp metadataEntries { label } }
        }
      }
    }
  }
}
"""


LAUNCH_BACKFILL = """
mutation LaunchBackfill($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on Error { message }
    ... on PythonError { stack }
  }
}
"""


BACKFILL = """
query Backfill($id: String!) {
  partitionBackfillOrError(backfillId: $id) {
    __typename
    ... on PartitionBackfill {
      id
      status
      isAssetBackfill
      partitionNames
      error { message stack }
      runs { runId status tags { key value } }
    }
    ... on Error { message }
  }
}
"""


LAUNCH_RUN = """
mutation LaunchRun($params: ExecutionParams!) {
  launchRun(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId status } }
    ... on RunConfigValidationInvalid { errors { message } }
    ... on Error { message }
    ... on PythonError { stack }
  }
}
"""


MANIFEST = """
query Manifest($key: AssetKeyInput!) {
  assetNodeOrError(assetKey: $key) {
    ... on AssetNode {
      assetMaterializations(limit: 1) {
        runId
        partition
        metadataEntries {
          __typename
          label
          ... on TextMetadataEntry { text }
          ... on PathMetadataEntry { path }
          ... on BoolMetadataEntry { boolValue }
          ... on IntMetadataEntry { intValue }
        }
      }
      assetChecksOrError {
        __typename
        ... on AssetChecks {
          checks {
            name
            blocking
            executionForLatestMaterialization {
              runId
              status
              evaluation { success description }
            }
          }
        }
      }
    }
  }
}
"""
