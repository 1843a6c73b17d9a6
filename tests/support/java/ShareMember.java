// One member of a share group (KIP-932) for the integration tests, run with Java's
// single-file source launcher on the Kafka jars' classpath:
//
//     java -cp 'libs/*' ShareMember.java <bootstrap> <topic> <group> [release-first]
//
// Sets the group's share.auto.offset.reset to earliest (records produced before it joined
// are delivered), then consumes, printing "record <value>" per record.  With
// "release-first" it acknowledges explicitly (ShareAcknowledge): each record's first
// delivery released (delivered again), the next accepted, printing "record <value>
// <delivery count>".  When stdin closes
// it leaves the group (KafkaShareConsumer.close sends the leave heartbeat) and prints
// "closed".
import java.io.InputStream;
import java.time.Duration;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AlterConfigOp;
import org.apache.kafka.clients.admin.ConfigEntry;
import org.apache.kafka.clients.consumer.AcknowledgeType;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaShareConsumer;
import org.apache.kafka.common.config.ConfigResource;
import org.apache.kafka.common.errors.WakeupException;
import org.apache.kafka.common.serialization.StringDeserializer;

public class ShareMember {
    public static void main(String[] args) throws Exception {
        String bootstrap = args[0], topic = args[1], group = args[2];
        try (Admin admin = Admin.create(Map.of("bootstrap.servers", bootstrap))) {
            ConfigResource resource = new ConfigResource(ConfigResource.Type.GROUP, group);
            AlterConfigOp earliest = new AlterConfigOp(
                new ConfigEntry("share.auto.offset.reset", "earliest"), AlterConfigOp.OpType.SET);
            admin.incrementalAlterConfigs(Map.of(resource, List.of(earliest))).all().get();
        }
        Properties props = new Properties();
        props.put("bootstrap.servers", bootstrap);
        props.put("group.id", group);
        boolean releaseFirst = args.length > 3 && args[3].equals("release-first");
        if (releaseFirst) {
            props.put("share.acknowledgement.mode", "explicit");
        }
        KafkaShareConsumer<String, String> consumer = new KafkaShareConsumer<>(
            props, new StringDeserializer(), new StringDeserializer());
        Thread stdin = new Thread(() -> {
            try (InputStream in = System.in) {
                while (in.read() >= 0) {
                    // nothing to do until the test closes our stdin
                }
            } catch (Exception ignored) {
                // closed either way
            }
            consumer.wakeup();
        });
        stdin.setDaemon(true);
        consumer.subscribe(List.of(topic));
        stdin.start();
        try {
            while (true) {
                for (ConsumerRecord<String, String> record : consumer.poll(Duration.ofMillis(500))) {
                    if (!releaseFirst) {
                        System.out.println("record " + record.value());
                        continue;
                    }
                    short count = record.deliveryCount().orElse((short) 0);
                    System.out.println("record " + record.value() + " " + count);
                    consumer.acknowledge(record, count < 2 ? AcknowledgeType.RELEASE
                                                           : AcknowledgeType.ACCEPT);
                }
                if (releaseFirst) {
                    consumer.commitSync();
                }
                System.out.flush();
            }
        } catch (WakeupException stopping) {
            // stdin closed: leave the group
        }
        consumer.close(Duration.ofSeconds(30));
        System.out.println("closed");
        System.out.flush();
    }
}
