// Java's admin client going through a tenant's calls on its own topic, for the integration
// tests of topic prefixes; run with Java's single-file source launcher on the Kafka jars'
// classpath:
//
//     java -cp 'libs/*' TenantAdmin.java <bootstrap> <client id> <topic> <other> <group> <broker id>
//
// Creates <topic> (2 partitions), writes 3 records to its partition 0, then makes one
// call after another (describe by name and by id, partitions, configs, offsets, records
// deleted, producers, log dirs, preferred election, reassignment, a group's offsets,
// <other> described, the topic deleted), printing "<call> ok <what it got>" or
// "<call> <the exception's class>" for each.
import java.util.List;
import java.util.Map;
import java.util.Optional;
import java.util.Set;
import java.util.TreeSet;
import java.util.concurrent.Callable;
import java.util.concurrent.ExecutionException;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AlterConfigOp;
import org.apache.kafka.clients.admin.ConfigEntry;
import org.apache.kafka.clients.admin.LogDirDescription;
import org.apache.kafka.clients.admin.NewPartitionReassignment;
import org.apache.kafka.clients.admin.NewPartitions;
import org.apache.kafka.clients.admin.NewTopic;
import org.apache.kafka.clients.admin.OffsetSpec;
import org.apache.kafka.clients.admin.RecordsToDelete;
import org.apache.kafka.clients.admin.TopicDescription;
import org.apache.kafka.clients.consumer.OffsetAndMetadata;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.ElectionType;
import org.apache.kafka.common.TopicCollection;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.TopicPartitionReplica;
import org.apache.kafka.common.Uuid;
import org.apache.kafka.common.config.ConfigResource;
import org.apache.kafka.common.serialization.StringSerializer;

public class TenantAdmin {
    static void report(String call, Callable<String> body) {
        try {
            System.out.println(call + " ok " + body.call());
        } catch (ExecutionException failed) {
            System.out.println(call + " " + failed.getCause().getClass().getSimpleName());
        } catch (Exception failed) {
            System.out.println(call + " " + failed.getClass().getSimpleName());
        }
        System.out.flush();
    }

    public static void main(String[] args) throws Exception {
        String bootstrap = args[0], clientId = args[1], topic = args[2], other = args[3];
        String group = args[4];
        int broker = Integer.parseInt(args[5]);
        Map<String, Object> conf = Map.of("bootstrap.servers", bootstrap, "client.id", clientId);
        TopicPartition first = new TopicPartition(topic, 0);
        try (Admin admin = Admin.create(conf)) {
            report("create", () -> {
                admin.createTopics(List.of(new NewTopic(topic, 2, (short) 1))).all().get();
                return topic;
            });
            try (KafkaProducer<String, String> producer = new KafkaProducer<>(
                    conf, new StringSerializer(), new StringSerializer())) {
                for (int i = 0; i < 3; i++) {
                    producer.send(new ProducerRecord<>(topic, 0, null, "v" + i)).get();
                }
            }
            report("list", () -> String.join(",", new TreeSet<>(admin.listTopics().names().get())));
            report("describe", () -> {
                TopicDescription d = admin.describeTopics(List.of(topic)).allTopicNames().get().get(topic);
                return d.name() + " " + d.partitions().size();
            });
            report("describe-by-id", () -> {
                Uuid id = admin.describeTopics(List.of(topic)).allTopicNames().get().get(topic).topicId();
                return admin.describeTopics(TopicCollection.ofTopicIds(List.of(id)))
                    .allTopicIds().get().get(id).name();
            });
            report("partitions", () -> {
                admin.createPartitions(Map.of(topic, NewPartitions.increaseTo(3))).all().get();
                return String.valueOf(admin.describeTopics(List.of(topic)).allTopicNames().get()
                    .get(topic).partitions().size());
            });
            ConfigResource resource = new ConfigResource(ConfigResource.Type.TOPIC, topic);
            report("config", () -> {
                AlterConfigOp op = new AlterConfigOp(new ConfigEntry("retention.ms", "3600000"),
                                                     AlterConfigOp.OpType.SET);
                admin.incrementalAlterConfigs(Map.of(resource, List.of(op))).all().get();
                return admin.describeConfigs(List.of(resource)).all().get().get(resource)
                    .get("retention.ms").value();
            });
            report("offsets", () -> String.valueOf(admin.listOffsets(Map.of(first, OffsetSpec.latest()))
                .partitionResult(first).get().offset()));
            report("delete-records", () -> String.valueOf(admin.deleteRecords(
                Map.of(first, RecordsToDelete.beforeOffset(1))).lowWatermarks().get(first).get()
                .lowWatermark()));
            report("producers", () -> String.valueOf(admin.describeProducers(List.of(first))
                .partitionResult(first).get().activeProducers().size()));
            report("log-dirs", () -> {
                Set<String> names = new TreeSet<>();
                for (LogDirDescription dir : admin.describeLogDirs(List.of(broker))
                        .allDescriptions().get().get(broker).values()) {
                    for (TopicPartition partition : dir.replicaInfos().keySet()) {
                        names.add(partition.topic());
                    }
                }
                return String.join(",", names);
            });
            report("replica-log-dir", () -> {
                TopicPartitionReplica replica = new TopicPartitionReplica(topic, 0, broker);
                String dir = admin.describeReplicaLogDirs(List.of(replica)).all().get().get(replica)
                    .getCurrentReplicaLogDir();
                return dir == null ? "none" : "found";
            });
            report("elect", () -> {
                Map<TopicPartition, Optional<Throwable>> elected = admin.electLeaders(
                    ElectionType.PREFERRED, Set.of(first)).partitions().get();
                return elected.keySet() + " "
                    + elected.get(first).map(e -> e.getClass().getSimpleName()).orElse("elected");
            });
            report("reassign", () -> {
                admin.alterPartitionReassignments(Map.of(first, Optional.of(
                    new NewPartitionReassignment(List.of(broker))))).all().get();
                return String.valueOf(admin.listPartitionReassignments(Set.of(first))
                    .reassignments().get().keySet());
            });
            report("group-offsets", () -> {
                admin.alterConsumerGroupOffsets(group, Map.of(first, new OffsetAndMetadata(2)))
                    .all().get();
                return String.valueOf(admin.listConsumerGroupOffsets(group)
                    .partitionsToOffsetAndMetadata().get().get(first).offset());
            });
            report("delete-group-offsets", () -> {
                admin.deleteConsumerGroupOffsets(group, Set.of(first)).all().get();
                return String.valueOf(admin.listConsumerGroupOffsets(group)
                    .partitionsToOffsetAndMetadata().get().keySet());
            });
            report("other", () -> admin.describeTopics(List.of(other)).allTopicNames().get()
                .keySet().toString());
            report("delete", () -> {
                admin.deleteTopics(List.of(topic)).all().get();
                return topic;
            });
        }
    }
}
